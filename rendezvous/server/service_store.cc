// RendezvousService: blocking store calls (Get with wait_ms > 0, Wait).
//
// A blocked call is a StoreWaiter registered under its job. It is re-checked
// whenever the job shows up in TakeChangedJobs, so it completes as soon as
// its keys exist; the timer ends it at its deadline; OnCancel ends it when
// the client gives up (including the client's own deadline).
#include <exception>

#include "absl/strings/str_cat.h"
#include "rendezvous/server/service.h"
#include "rendezvous/server/service_reactors.h"

namespace muster::rdzv {

grpc::ServerUnaryReactor* RendezvousService::Get(grpc::CallbackServerContext* context,
                                                 const pb::GetRequest* request,
                                                 pb::GetResponse* response) {
  if (request->wait_ms() <= 0) {
    return RunUnary(context, Rpc::kGet, false, [&](const std::string& secret) -> absl::Status {
      if (request->wait_ms() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("wait_ms must be >= 0, got ", request->wait_ms()));
      }
      absl::Status allowed = machine_.Authorize(request->job_id(), secret);
      if (!allowed.ok()) return allowed;
      absl::StatusOr<std::string> value =
          machine_.Get(request->job_id(), request->round(), request->key());
      if (!value.ok()) return value.status();
      response->set_value(*std::move(value));
      return absl::OkStatus();
    });
  }
  auto* waiter =
      new StoreWaiter(this, Rpc::kGet, request->job_id(), request->round(), {request->key()},
                      response, absl::Now() + absl::Milliseconds(request->wait_ms()));
  return StartWaiter(waiter, context);
}

grpc::ServerUnaryReactor* RendezvousService::Wait(grpc::CallbackServerContext* context,
                                                  const pb::WaitRequest* request,
                                                  pb::WaitResponse* /*response*/) {
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  absl::Duration wait = absl::Milliseconds(std::max<int64_t>(0, request->wait_ms()));
  auto* waiter = new StoreWaiter(this, Rpc::kWait, request->job_id(), request->round(),
                                 std::move(keys), nullptr, absl::Now() + wait);
  if (request->wait_ms() < 0) {
    waiter->Complete(
        absl::InvalidArgumentError(absl::StrCat("wait_ms must be >= 0, got ", request->wait_ms())));
    return waiter;
  }
  // Too many keys is RESOURCE_EXHAUSTED from the first check (AllSet).
  return StartWaiter(waiter, context);
}

grpc::ServerUnaryReactor* RendezvousService::StartWaiter(StoreWaiter* waiter,
                                                         grpc::CallbackServerContext* context) {
  absl::Status status = options_.tokens.Check(*context);
  // Set when the first check answered from the state machine: what it saw
  // may not be on disk yet, so the answer waits until that much is.
  std::optional<uint64_t> observed;
  if (status.ok()) {
    std::string secret = PresentedJobSecret(*context);
    absl::MutexLock lock(&mu_);
    try {
      std::optional<absl::Status> outcome;
      if (shutting_down_) {
        outcome = absl::UnavailableError("rendezvous server is shutting down");
      } else if (absl::Status allowed = machine_.Authorize(waiter->job_id_, secret);
                 !allowed.ok()) {
        outcome = allowed;
      } else {
        outcome = CheckWaiter(waiter);
        if (outcome.has_value() && committer_) observed = mutation_sequence_;
      }
      if (!outcome.has_value() && waiter->deadline_ <= absl::Now()) {
        outcome =
            absl::DeadlineExceededError(absl::StrCat("keys of job '", waiter->job_id_, "' round ",
                                                     waiter->round_, " absent and wait_ms is 0"));
      }
      auto already = waiters_.find(waiter->job_id_);
      if (!outcome.has_value() && already != waiters_.end() &&
          already->second.size() >= options_.max_waiters_per_job) {
        outcome = absl::ResourceExhaustedError(
            absl::StrCat("job '", waiter->job_id_, "' already has ",
                         Counted(already->second.size(), "blocked Get or Wait call"), "; ",
                         DescribeLimit(options_.max_waiters_per_job, "--max-waiters-per-job")));
      }
      if (!outcome.has_value()) {
        RegisterWaiter(waiter);
        return waiter;
      }
      status = *outcome;
    } catch (const std::exception& error) {
      status =
          absl::InternalError(absl::StrCat("unexpected error in a store call: ", error.what()));
      observed.reset();
    }
  }
  if (observed.has_value()) {
    committer_->RunWhenDurable(*observed, [waiter, status](absl::Status durable) {
      waiter->Complete(status.ok() ? durable : status);
    });
    return waiter;
  }
  waiter->Complete(status);
  return waiter;
}

std::optional<absl::Status> RendezvousService::CheckWaiter(StoreWaiter* waiter) {
  // A vanished job (dropped after retention) is NOT_FOUND, not a key that
  // might still appear.
  absl::StatusOr<uint64_t> exists = machine_.Version(waiter->job_id_);
  if (!exists.ok()) return exists.status();
  if (waiter->get_response_ != nullptr) {
    absl::StatusOr<std::string> value =
        machine_.Get(waiter->job_id_, waiter->round_, waiter->keys_.front());
    if (value.ok()) {
      waiter->get_response_->set_value(*std::move(value));
      return absl::OkStatus();
    }
    if (absl::IsNotFound(value.status())) return std::nullopt;
    return value.status();  // ABORTED once the round is over, ...
  }
  // Checked on every change to the job: presence only, nothing copied.
  absl::StatusOr<bool> all_set = machine_.AllSet(waiter->job_id_, waiter->round_, waiter->keys_);
  if (!all_set.ok()) return all_set.status();
  if (!*all_set) return std::nullopt;
  return absl::OkStatus();
}

void RendezvousService::RegisterWaiter(StoreWaiter* waiter) {
  waiters_[waiter->job_id_].insert(waiter);
  waiter_deadlines_.emplace(waiter->deadline_, waiter);
  if (timer_wakes_at_real_ != absl::InfinitePast() && waiter->deadline_ < timer_wakes_at_real_) {
    timer_wake_.Signal();
  }
}

bool RendezvousService::UnregisterWaiter(StoreWaiter* waiter) {
  auto job = waiters_.find(waiter->job_id_);
  if (job == waiters_.end() || job->second.erase(waiter) == 0) return false;
  if (job->second.empty()) waiters_.erase(job);
  waiter_deadlines_.erase({waiter->deadline_, waiter});
  return true;
}

void RendezvousService::CancelWaiter(StoreWaiter* waiter) {
  bool mine;
  {
    absl::MutexLock lock(&mu_);
    mine = UnregisterWaiter(waiter);
  }
  if (mine) waiter->Complete(absl::CancelledError("call cancelled by the client"));
}

}  // namespace muster::rdzv
