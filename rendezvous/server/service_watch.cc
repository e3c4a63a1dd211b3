// RendezvousService: Watch streams.
//
// A stream gets the job's current state at once (if newer than
// after_version) and then every newer version, coalesced: while one write
// is in flight only the newest offered state is kept. A finished job's
// state is the last message (then OK); a dropped job ends the stream with
// NOT_FOUND; shutdown ends it with UNAVAILABLE. A stream beyond the
// server-wide or the per-job quota is refused with RESOURCE_EXHAUSTED naming
// the quota, so one job cannot take every stream.
#include "absl/strings/str_cat.h"
#include "rendezvous/server/service.h"
#include "rendezvous/server/service_reactors.h"

namespace muster::rdzv {
namespace {

bool IsFinished(pb::Phase phase) {
  return phase == pb::SUCCEEDED || phase == pb::FAILED || phase == pb::CLOSED;
}

}  // namespace

grpc::ServerWriteReactor<pb::JobState>* RendezvousService::Watch(
    grpc::CallbackServerContext* context, const pb::WatchRequest* request) {
  std::shared_ptr<WatchReactor> watcher =
      WatchReactor::Create(this, request->job_id(), request->after_version());
  WatchReactor* reactor = watcher.get();
  absl::Status status = options_.tokens.Check(*context);
  WatchReactor::SharedState initial;
  if (status.ok()) {
    std::string secret = PresentedJobSecret(*context);
    absl::MutexLock lock(&mu_);
    try {
      if (shutting_down_) {
        status = absl::UnavailableError("rendezvous server is shutting down");
      } else if (open_watches_.load() >= options_.max_watch_streams) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "the server already has ", Counted(open_watches_.load(), "open Watch stream"), "; ",
            DescribeLimit(options_.max_watch_streams, "--max-watch-streams")));
      } else if (auto job = watchers_.find(request->job_id());
                 job != watchers_.end() &&
                 job->second.size() >= options_.max_watch_streams_per_job) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "job ", request->job_id(), " already has ",
            Counted(job->second.size(), "open Watch stream"), "; per job, ",
            DescribeLimit(options_.max_watch_streams_per_job, "--max-watch-streams-per-job")));
      } else {
        status = machine_.Authorize(request->job_id(), secret);
      }
      if (status.ok()) {
        auto state =
            std::make_shared<const absl::StatusOr<pb::JobState>>(machine_.State(request->job_id()));
        status = state->status();
        if (status.ok()) {
          watchers_[request->job_id()].emplace(reactor, watcher);
          open_watches_.fetch_add(1);
          metrics_->AddWatchStreams(1);
          initial = std::move(state);
        }
      }
    } catch (const std::exception& error) {
      status = absl::InternalError(absl::StrCat("unexpected error in Watch: ", error.what()));
    }
  }
  if (!status.ok()) {
    reactor->Terminate(status);
  } else {
    // A change between registering and here was offered already and is
    // newer; Offer drops this one then.
    reactor->Offer(std::move(initial));
  }
  return reactor;
}

void RendezvousService::UnregisterWatcher(WatchReactor* watcher) {
  absl::MutexLock lock(&mu_);
  auto job = watchers_.find(watcher->job_id());
  if (job == watchers_.end() || job->second.erase(watcher) == 0) return;
  if (job->second.empty()) watchers_.erase(job);
  open_watches_.fetch_sub(1);
  metrics_->AddWatchStreams(-1);
}

std::shared_ptr<RendezvousService::WatchReactor> RendezvousService::WatchReactor::Create(
    RendezvousService* service, std::string job_id, uint64_t after_version) {
  std::shared_ptr<WatchReactor> watcher(
      new WatchReactor(service, std::move(job_id), after_version));
  watcher->self_ = watcher;
  return watcher;
}

void RendezvousService::WatchReactor::Offer(SharedState state) {
  Step step;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || end_with_.has_value()) return;
    if (!state->ok()) {
      end_with_ = state->status();
      queued_.reset();
    } else {
      uint64_t newest = queued_ ? (*queued_)->version() : last_sent_version_;
      if ((*state)->version() > newest) {
        queued_ = std::move(state);
      } else if (!queued_ && !write_in_flight_ && IsFinished((*state)->phase())) {
        // The client already holds the final state (after_version).
        end_with_ = absl::OkStatus();
      }
    }
    step = NextStep();
  }
  Perform(step);
}

void RendezvousService::WatchReactor::Terminate(const absl::Status& status) {
  Step step;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!end_with_.has_value()) end_with_ = status;
    queued_.reset();
    step = NextStep();
  }
  Perform(step);
}

RendezvousService::WatchReactor::Step RendezvousService::WatchReactor::NextStep() {
  if (finished_ || write_in_flight_) return Step::kNone;
  if (end_with_.has_value()) {
    finished_ = true;
    finish_status_ = *end_with_;
    return Step::kFinish;
  }
  if (!queued_) return Step::kNone;
  outgoing_ = std::move(queued_);
  queued_.reset();
  last_sent_version_ = (*outgoing_)->version();
  if (IsFinished((*outgoing_)->phase())) {
    finished_ = true;
    finish_status_ = absl::OkStatus();
    return Step::kWriteAndFinish;
  }
  write_in_flight_ = true;
  return Step::kWrite;
}

void RendezvousService::WatchReactor::Perform(Step step) {
  switch (step) {
    case Step::kNone:
      return;
    case Step::kWrite:
      StartWrite(&**outgoing_);
      return;
    case Step::kWriteAndFinish:
      StartWriteAndFinish(&**outgoing_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    case Step::kFinish: {
      absl::Status status;
      {
        absl::MutexLock lock(&mu_);
        status = finish_status_;
      }
      Finish(ToGrpcStatus(status));
      return;
    }
  }
}

void RendezvousService::WatchReactor::OnWriteDone(bool ok) {
  Step step;
  {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (!ok && !end_with_.has_value()) {
      // The client is gone; the call still has to be finished.
      end_with_ = absl::CancelledError("watch stream broken");
      queued_.reset();
    }
    step = NextStep();
  }
  Perform(step);
}

void RendezvousService::WatchReactor::OnCancel() {
  Terminate(absl::CancelledError("watch cancelled by the client"));
}

void RendezvousService::WatchReactor::OnDone() {
  service_->UnregisterWatcher(this);
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = finish_status_;
  }
  service_->metrics_->RecordRpc(Rpc::kWatch, static_cast<int>(status.code()),
                                absl::Now() - started_);
  // The last owner may be this reference; nothing touches members after.
  std::shared_ptr<WatchReactor> last_reference = std::move(self_);
}

}  // namespace muster::rdzv
