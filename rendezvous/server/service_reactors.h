// Private to the service: the reactors behind blocked store calls and Watch
// streams. Included only by service*.cc.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/server/service.h"

namespace muster::rdzv {

// A Get with wait_ms > 0, or a Wait, that found its keys absent. It sits in
// the service's registries (guarded by the service's mu_) until a change
// satisfies it, its deadline passes, the client cancels, or the server shuts
// down; whoever takes it out of the registries finishes it, exactly once.
// gRPC deletes it (OnDone) after Finish.
class RendezvousService::StoreWaiter final : public grpc::ServerUnaryReactor {
 public:
  StoreWaiter(RendezvousService* service, Rpc rpc, std::string job_id, uint64_t round,
              std::vector<std::string> keys, pb::GetResponse* get_response, absl::Time deadline)
      : service_(service),
        rpc_(rpc),
        job_id_(std::move(job_id)),
        round_(round),
        keys_(std::move(keys)),
        get_response_(get_response),
        deadline_(deadline),
        started_(absl::Now()) {}

  // Replies with `status` and records the call's metrics. Call once.
  void Complete(const absl::Status& status) {
    service_->metrics_->RecordRpc(rpc_, static_cast<int>(status.code()), absl::Now() - started_);
    Finish(ToGrpcStatus(status));
  }

  void OnCancel() override { service_->CancelWaiter(this); }
  void OnDone() override { delete this; }

  RendezvousService* const service_;
  const Rpc rpc_;
  const std::string job_id_;
  const uint64_t round_;
  const std::vector<std::string> keys_;  // one key for Get
  pb::GetResponse* const get_response_;  // null for Wait
  const absl::Time deadline_;            // real time (absl::Now)
  const absl::Time started_;
};

// One Watch stream. At most one write is in flight; states offered
// meanwhile are coalesced into the newest, sent when the write completes.
// Owned by a shared_ptr to itself (self_) until OnDone, and by the
// service's registry while registered.
class RendezvousService::WatchReactor final : public grpc::ServerWriteReactor<pb::JobState> {
 public:
  using SharedState = std::shared_ptr<const absl::StatusOr<pb::JobState>>;

  // Creates a reactor that owns itself until OnDone.
  static std::shared_ptr<WatchReactor> Create(RendezvousService* service, std::string job_id,
                                              uint64_t after_version);

  // Sends `state` if it is newer than anything sent or queued; a finished
  // phase is sent and then the stream ends OK; NOT_FOUND (job dropped) ends
  // the stream with NOT_FOUND.
  void Offer(SharedState state) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream with `status` as soon as no write is in flight,
  // dropping any queued state (shutdown, or a rejected call).
  void Terminate(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& job_id() const { return job_id_; }

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  WatchReactor(RendezvousService* service, std::string job_id, uint64_t after_version)
      : service_(service),
        job_id_(std::move(job_id)),
        started_(absl::Now()),
        last_sent_version_(after_version) {}

  // What to do next, decided under mu_ and carried out after releasing it
  // so that gRPC never runs a reaction into a lock this thread holds.
  enum class Step { kNone, kWrite, kWriteAndFinish, kFinish };
  Step NextStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Perform(Step step) ABSL_LOCKS_EXCLUDED(mu_);

  RendezvousService* const service_;
  const std::string job_id_;
  const absl::Time started_;

  absl::Mutex mu_;
  uint64_t last_sent_version_ ABSL_GUARDED_BY(mu_);
  SharedState queued_ ABSL_GUARDED_BY(mu_);  // newest unsent state
  std::optional<absl::Status> end_with_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish (or WriteAndFinish) called
  absl::Status finish_status_ ABSL_GUARDED_BY(mu_);
  // The message being written, shared with every other stream of the job
  // (1000 streams must not hold 1000 copies of a 1000-member state); kept
  // alive until its write completes.
  SharedState outgoing_;
  std::shared_ptr<WatchReactor> self_;
};

}  // namespace muster::rdzv

// ---- the unary-call skeleton shared by service*.cc

namespace muster::rdzv {

template <typename Call>
grpc::ServerUnaryReactor* RendezvousService::RunUnary(grpc::CallbackServerContext* context, Rpc rpc,
                                                      bool may_move_deadlines, Call call) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Time started = absl::Now();
  absl::Status status = options_.tokens.Check(*context);
  Effects effects;
  if (status.ok()) {
    std::string secret = PresentedJobSecret(*context);
    absl::MutexLock lock(&mu_);
    // Nothing a client sends may take the server down: an exception from
    // deep inside protobuf or the state machine becomes INTERNAL.
    try {
      status = call(secret);
    } catch (const std::exception& error) {
      status = absl::InternalError(
          absl::StrCat("unexpected error in ", RpcName(rpc), ": ", error.what()));
    } catch (...) {
      status = absl::InternalError(absl::StrCat("unexpected error in ", RpcName(rpc)));
    }
    effects = TakeEffects(may_move_deadlines);
  }
  Metrics* metrics = metrics_;
  AfterCommit(std::move(effects), [reactor, status, started, metrics, rpc](absl::Status durable) {
    absl::Status reply = status.ok() ? durable : status;
    metrics->RecordRpc(rpc, static_cast<int>(reply.code()), absl::Now() - started);
    reactor->Finish(ToGrpcStatus(reply));
  });
  return reactor;
}

}  // namespace muster::rdzv
