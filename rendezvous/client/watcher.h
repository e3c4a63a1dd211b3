// JobWatcher: follows one job's state through the server's Watch stream.
//
// A background thread holds the stream open. When it breaks with
// UNAVAILABLE (server restart, network, a dead connection found by the
// channel's keepalive), the watcher reconnects after a jittered backoff,
// asking only for versions after the last one it saw, so callers see each
// state once and in version order (the server coalesces: a state replaced
// before it was sent is skipped, never reordered). Each stream has the
// deadline ClientOptions::watch_stream_deadline; when it passes the
// watcher resumes the same way, at once. A terminal phase (SUCCEEDED,
// FAILED, CLOSED) ends the stream normally and the watcher stops.
// RESOURCE_EXHAUSTED (a Watch stream quota) is retried with backoff
// ClientOptions::resource_exhausted_attempts times in a row, then is
// final. Any other error (NOT_FOUND: unknown job; PERMISSION_DENIED;
// UNAUTHENTICATED; ...) is recorded as the watcher's permanent error at
// once. Either way every waiter is woken.
//
// Thread-safety: every method may be called from any thread. The callback
// runs on the watcher's thread, outside its lock; it may call latest() but
// must not call Stop() or destroy the watcher. The Client must outlive the
// watcher.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/client/rpc.h"

namespace muster::rdzv {

// True for SUCCEEDED, FAILED and CLOSED: the job will not change again.
bool IsTerminalPhase(pb::Phase phase);

class JobWatcher {
 public:
  using Callback = std::function<void(const pb::JobState&)>;

  // Starts watching `job_id` at once. `on_state`, if set, is called for
  // every state received. With `wait_for_job`, a job that does not exist
  // yet is waited for: NOT_FOUND before the first state is retried with
  // backoff, so a watcher may start before the join that creates its job.
  // (After a first state, NOT_FOUND means the job was dropped: permanent.)
  JobWatcher(Client* client, std::string job_id, Callback on_state = nullptr,
             bool wait_for_job = false);
  ~JobWatcher();

  JobWatcher(const JobWatcher&) = delete;
  JobWatcher& operator=(const JobWatcher&) = delete;

  // Ends the stream and joins the thread. Idempotent.
  void Stop();

  // The first state, starting from the latest one already received, for
  // which `predicate` is true. The predicate runs under the watcher's lock:
  // keep it cheap and do not call the watcher from it. Errors:
  // DEADLINE_EXCEEDED at `deadline`; the stream's permanent error;
  // FAILED_PRECONDITION if the job reached a terminal phase and no state
  // matched; CANCELLED after Stop().
  absl::StatusOr<pb::JobState> WaitFor(const std::function<bool(const pb::JobState&)>& predicate,
                                       absl::Time deadline) const;

  // The newest state received, if any.
  std::optional<pb::JobState> latest() const;

  // OK unless the stream failed permanently.
  absl::Status status() const;

  // How many times the stream was re-established after breaking or
  // reaching its deadline.
  int reconnects() const;

  const std::string& job_id() const { return job_id_; }

 private:
  void Run();
  void Publish(const pb::JobState& state);

  // Recent states kept so a slow waiter still sees each one.
  static constexpr size_t kHistory = 256;

  Client* const client_;
  const std::string job_id_;
  const Callback on_state_;
  const bool wait_for_job_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // terminal phase reached
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::deque<pb::JobState> history_ ABSL_GUARDED_BY(mu_);
  uint64_t received_ ABSL_GUARDED_BY(mu_) = 0;  // states ever received
  int reconnects_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;  // last: starts after every field is ready
};

// What JoinAndWaitForRound hands back.
struct RoundAssignment {
  std::string member_id;
  int64_t lease_ttl_ms = 0;
  pb::JobState state;  // RUNNING, with this member among state.members
  pb::Member self;     // this member's entry: group_rank, rank_offset
};

// Joins `request.job_id` (re-joining with the member_id the server gave, if
// the round it joined ends without it) and waits until the job is RUNNING a
// round that includes this member. While waiting it renews the lease every
// ttl/3, so the caller can start its LeaseKeeper afterwards. `watcher` must
// watch the same job; nullptr makes a temporary one. Errors: the Join's or
// KeepAlive's error; FAILED_PRECONDITION if the job ends (message names the
// phase and status_message); DEADLINE_EXCEEDED at `deadline`.
absl::StatusOr<RoundAssignment> JoinAndWaitForRound(Client& client, const pb::JoinRequest& request,
                                                    JobWatcher* watcher, absl::Time deadline);

}  // namespace muster::rdzv
