#include "rendezvous/client/lease_keeper.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::rdzv {
namespace {

// RESOURCE_EXHAUSTED is not transient here: Client::KeepAlive has already
// tried it a bounded number of times (rpc.h), so it is final.
bool IsTransient(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace

LeaseKeeper::LeaseKeeper(Client* client, std::string job_id, std::string member_id,
                         absl::Duration lease_ttl, absl::Duration renew_every)
    : client_(client),
      job_id_(std::move(job_id)),
      member_id_(std::move(member_id)),
      renew_every_(renew_every),
      lease_ttl_(lease_ttl),
      thread_([this] { Run(); }) {}

LeaseKeeper::~LeaseKeeper() { Stop(); }

void LeaseKeeper::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cancellation_.Cancel();
  if (thread_.joinable()) thread_.join();
}

absl::Status LeaseKeeper::status() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

absl::Status LeaseKeeper::WaitForFailure(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ || stopping_ || !error_.ok();
  };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  return error_;
}

int64_t LeaseKeeper::renewals() const {
  absl::MutexLock lock(&mu_);
  return renewals_;
}

absl::Status LeaseKeeper::last_transient_error() const {
  absl::MutexLock lock(&mu_);
  return last_transient_error_;
}

uint64_t LeaseKeeper::last_version() const {
  absl::MutexLock lock(&mu_);
  return last_version_;
}

absl::Duration LeaseKeeper::RenewalInterval() const {
  if (renew_every_ > absl::ZeroDuration() && renew_every_ < lease_ttl_) return renew_every_;
  return lease_ttl_ / 3;
}

void LeaseKeeper::Run() {
  pb::KeepAliveRequest request;
  request.set_job_id(job_id_);
  request.set_member_id(member_id_);
  absl::Time next_renewal;
  {
    absl::MutexLock lock(&mu_);
    next_renewal = absl::Now() + RenewalInterval();
  }
  int failures_in_a_row = 0;
  for (;;) {
    absl::Duration ttl;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), next_renewal);
      if (stopping_) break;
      ttl = lease_ttl_;
    }
    // One renewal may take up to a third of the ttl, retries included, so
    // a slow attempt still leaves time for another before the lease lapses.
    CallOptions call;
    call.timeout = std::max(ttl / 3, absl::Milliseconds(10));
    call.cancellation = &cancellation_;
    absl::StatusOr<pb::KeepAliveResponse> response = client_->KeepAlive(request, call);

    absl::MutexLock lock(&mu_);
    if (stopping_) break;
    if (response.ok()) {
      failures_in_a_row = 0;
      last_transient_error_ = absl::OkStatus();
      ++renewals_;
      last_version_ = response->version();
      if (response->lease_ttl_ms() > 0) {
        lease_ttl_ = absl::Milliseconds(response->lease_ttl_ms());
      }
      next_renewal = absl::Now() + RenewalInterval();
    } else if (IsTransient(response.status().code())) {
      last_transient_error_ = response.status();
      next_renewal = absl::Now() + JitteredBackoff(client_->options().backoff, failures_in_a_row++);
    } else {
      error_ = absl::Status(response.status().code(),
                            absl::StrCat("lease of member ", member_id_, " in job ", job_id_,
                                         " lost: ", response.status().message()));
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  finished_ = true;
}

}  // namespace muster::rdzv
