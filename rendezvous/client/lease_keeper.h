// LeaseKeeper: keeps one member's lease alive from a background thread.
//
// Renews every ttl/3 (the ttl is updated from each KeepAliveResponse).
// Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN) are retried
// with jittered backoff, so a server restart shorter than the lease, or a
// connection that died silently (found by the channel's keepalive, see
// rpc.h), is ridden out. The first permanent failure (NOT_FOUND: the
// server forgot the member; FAILED_PRECONDITION: lease expired or job over;
// RESOURCE_EXHAUSTED once Client::KeepAlive's bounded retry of it is spent;
// PERMISSION_DENIED, UNAUTHENTICATED, ...) is recorded, renewals stop and
// every WaitForFailure caller is woken; status() returns it from then on.
//
// Thread-safety: every method may be called from any thread. The Client
// must outlive the keeper. Stop() and the destructor cancel the renewal in
// flight and join the thread promptly.
#pragma once

#include <cstdint>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/client/rpc.h"

namespace muster::rdzv {

class LeaseKeeper {
 public:
  // Starts renewing every `renew_every`, or every lease_ttl/3 where that is
  // zero or not shorter than the lease (which would lapse between
  // renewals); the first renewal is due one interval from now (the caller
  // has just joined or renewed). REQUIRES: lease_ttl > 0.
  LeaseKeeper(Client* client, std::string job_id, std::string member_id, absl::Duration lease_ttl,
              absl::Duration renew_every = absl::ZeroDuration());
  ~LeaseKeeper();

  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // Stops renewing and joins the thread. Idempotent. Does not Leave.
  void Stop();

  // OK while healthy or after Stop(); the first permanent error otherwise.
  absl::Status status() const;

  // Blocks until a permanent error, Stop(), or `deadline`; returns status().
  absl::Status WaitForFailure(absl::Time deadline) const;

  // Successful renewals so far, and the job-state version the last one
  // reported (compare with a watcher's to spot a missed update).
  int64_t renewals() const;
  uint64_t last_version() const;

  // The latest transient failure (OK if the last renewal succeeded), for
  // diagnostics: why renewals are not getting through right now.
  absl::Status last_transient_error() const;

  const std::string& member_id() const { return member_id_; }

 private:
  void Run();
  // Between successful renewals, for the lease as the server last gave it.
  absl::Duration RenewalInterval() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Client* const client_;
  const std::string job_id_;
  const std::string member_id_;
  const absl::Duration renew_every_;
  Cancellation cancellation_;  // cancels the renewal in flight on Stop()

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // thread has exited
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Status last_transient_error_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ttl_ ABSL_GUARDED_BY(mu_);
  int64_t renewals_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;  // last: starts after every field is ready
};

}  // namespace muster::rdzv
