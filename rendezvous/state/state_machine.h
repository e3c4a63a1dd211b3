// The rendezvous service's state: jobs, members, rounds, leases and each
// round's key-value store, as a plain class.
//
// No threads, no gRPC, no clock of its own: every call that depends on time
// takes `now` (a monotonic instant from rendezvous/server/clock.h), so tests
// drive it with a fake clock. The gRPC layer (rendezvous/server/service.h)
// owns one StateMachine, serialises calls to it under one mutex, and
// translates.
//
// Thread-safety: none. The caller serialises every call.
//
// Errors (absl::StatusCode, mapped 1:1 to gRPC codes by the service):
//   INVALID_ARGUMENT     malformed request: empty or oversized id, empty key,
//                        min_nodes > max_nodes, nproc == 0, ...
//   NOT_FOUND            unknown job or member; absent key (Get)
//   FAILED_PRECONDITION  join settings that conflict with the job's (the
//                        message names the setting); job closed or failed;
//                        a round that has not started; an expired lease
//   ABORTED              a round that is over (stale caller: change nothing)
//   RESOURCE_EXHAUSTED   a Limits cap would be exceeded
//   PERMISSION_DENIED    wrong job secret
//   DATA_LOSS            Restore of a snapshot that is inconsistent
//
// Time: every call that takes `now` first applies the deadlines at or before
// `now` (as Tick(now) would), then acts. So a member whose lease lapsed is
// gone (NOT_FOUND, "join without a member_id") even if the service's timer
// has not fired yet, and a round whose last call passed has closed.
//
// Invariants (CheckInvariants, asserted by the tests after every event):
//   - ranks of a RUNNING round are unique and cover 0..nodes-1; rank
//     offsets are the prefix sums of nproc in group-rank order;
//   - rounds only increase; min_nodes <= nodes <= max_nodes when RUNNING;
//   - a member whose lease lapsed at t is gone once Tick(t') ran, t' >= t.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/rendezvous.pb.h"
#include "rendezvous/state/state.pb.h"

namespace muster::rdzv {

namespace pb = ::muster::rendezvous::v1;
namespace state = ::muster::rendezvous::state;  // rendezvous/state/state.proto

// Caps that keep one client from exhausting the server. Exceeding one gets
// RESOURCE_EXHAUSTED (a join_timeout_ms over its bound: INVALID_ARGUMENT);
// nothing is changed. Each message names the limit and its server flag.
//
// Caps bound growth, not what is already held: Restore accepts a state over
// lowered limits (an operator lowered a flag and restarted), and from then on
// only calls that would grow past a cap are refused.
struct Limits {
  size_t max_id_bytes = 256;  // job ids, member ids
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = 1 << 20;  // 1 MiB
  size_t max_keys_per_job = 100000;
  size_t max_members_per_job = 10000;
  size_t max_jobs = 10000;
  // Keys one MultiGet or Wait may name; a key named twice counts twice.
  size_t max_keys_per_request = 1000;
  // Bytes of values one MultiGet may return. At least max_value_bytes, so
  // every value can be read.
  size_t max_response_bytes = size_t{64} << 20;  // 64 MiB
  // What one job may hold in the state file (see StateMachine::JobBytes):
  // its store's keys and values, its members' ids, addresses and hostnames,
  // and its records. At least max_key_bytes + max_value_bytes.
  size_t max_job_bytes = size_t{64} << 20;  // 64 MiB
  // The same measure summed over every job. Together with what a job
  // records without asking (failures, status messages: at most
  // MaxUnrefusedJobBytes each) it stays below kMaxStateBytes, so the state
  // always serializes (ValidateLimits).
  size_t max_total_bytes = size_t{256} << 20;  // 256 MiB
  // The longest join_timeout_ms a new job may ask for.
  int64_t max_join_timeout_ms = 3'600'000;  // 1 hour
  // Closed, succeeded and failed jobs are dropped after this long; until
  // then they answer joins with FAILED_PRECONDITION ("job ... is closed").
  absl::Duration closed_retention = absl::Minutes(10);
  // A job every member has left (preempted and not requeued, or given up)
  // is dropped after this long without one: until then it keeps its place
  // in --max-jobs and its caller's quota. A requeue after that starts the
  // job afresh at round 0, which muster's worker resumes all the same.
  absl::Duration idle_retention = absl::Hours(24);
};

// The most a snapshot may take: protobuf cannot serialize 2 GiB or more;
// this leaves room for what the byte accounting does not charge exactly.
inline constexpr size_t kMaxStateBytes = size_t{1792} << 20;  // 1.75 GiB
// What a job may come to hold without a call that could be refused: its
// kept failures and its status message, at their largest under `limits`.
size_t MaxUnrefusedJobBytes(const Limits& limits);

// INVALID_ARGUMENT naming the flag when the limits contradict each other
// (max_response_bytes < max_value_bytes, ...) or when max_total_bytes plus
// max_jobs * MaxUnrefusedJobBytes exceeds kMaxStateBytes.
absl::Status ValidateLimits(const Limits& limits);

// The end of every limit refusal, naming the value and the server flag that
// sets it: DescribeLimit(4096, "--max-key-bytes") is
// "the limit is 4096 (rendezvous --max-key-bytes)".
std::string DescribeLimit(size_t limit, const char* flag);
// A count and its noun, singular for 1: "1 key", "3 keys".
std::string Counted(size_t count, const char* noun);

class StateMachine {
 public:
  explicit StateMachine(Limits limits = Limits());
  ~StateMachine();

  StateMachine(const StateMachine&) = delete;
  StateMachine& operator=(const StateMachine&) = delete;
  // Moves replace the whole state (the server's rollback to its last
  // durable state after a failed write).
  StateMachine(StateMachine&&) noexcept;
  StateMachine& operator=(StateMachine&&) noexcept;

  // ---- membership

  // The first join creates the job with request.config and, when `secret`
  // is non-empty, a job secret every later call must present. A join with
  // an empty member_id adds a new member (lease starts now); with a known
  // member_id it renews that member and puts it in the round being
  // gathered. A member of a RUNNING round that joins again ends that round
  // (MEMBER_REJOINED; no restart is counted) so a bigger world can form.
  // Any other join while a round RUNS waits for the next round
  // (JoinResponse.round = round + 1, counted in nodes_waiting). A join on a
  // finished job gets FAILED_PRECONDITION ("job ... is closed (...)").
  absl::StatusOr<pb::JoinResponse> Join(const pb::JoinRequest& request, const std::string& secret,
                                        absl::Time now);

  // Renews the member's lease to now + lease_ttl.
  absl::StatusOr<pb::KeepAliveResponse> KeepAlive(const pb::KeepAliveRequest& request,
                                                  absl::Time now);

  // Removes the member. If it was in the RUNNING round, the round ends
  // (MEMBER_LEFT; no restart counted).
  absl::Status Leave(const pb::LeaveRequest& request, absl::Time now);

  // Ends the running round at once (MEMBER_FAILED) and counts one restart;
  // once restarts exceed max_restarts the job is FAILED.
  absl::StatusOr<pb::JobState> ReportFailure(const pb::ReportFailureRequest& request,
                                             absl::Time now);

  // Marks the member done. When every member of the round is done the job
  // is SUCCEEDED.
  absl::StatusOr<pb::JobState> ReportDone(const pb::ReportDoneRequest& request, absl::Time now);

  // ---- store: keys of (job, round). None of these block; the service
  // implements waiting by retrying when the job shows up in
  // TakeChangedJobs().

  absl::Status Set(const pb::SetRequest& request);
  // NOT_FOUND when the key is absent.
  absl::StatusOr<std::string> Get(const std::string& job_id, uint64_t round,
                                  const std::string& key) const;
  absl::StatusOr<pb::AddResponse> Add(const pb::AddRequest& request);
  absl::StatusOr<pb::CompareAndSetResponse> CompareAndSet(const pb::CompareAndSetRequest& request);
  absl::StatusOr<pb::DeleteResponse> Delete(const pb::DeleteRequest& request);
  // RESOURCE_EXHAUSTED when the request names more than
  // max_keys_per_request keys or the values would pass max_response_bytes;
  // sizes are summed before anything is copied.
  absl::StatusOr<pb::MultiGetResponse> MultiGet(const pb::MultiGetRequest& request) const;
  // Whether every key is set in (job, round), copying nothing (what a
  // blocked Wait checks on every change). Errors as MultiGet's.
  absl::StatusOr<bool> AllSet(const std::string& job_id, uint64_t round,
                              const std::vector<std::string>& keys) const;

  // ---- admin and watch

  pb::ListJobsResponse ListJobs() const;
  // The watch view of a job (what Watch streams). NOT_FOUND if unknown.
  absl::StatusOr<pb::JobState> State(const std::string& job_id) const;
  // The version of State(job_id), without building it.
  absl::StatusOr<uint64_t> Version(const std::string& job_id) const;
  // State plus lease ages and the waiting/pending members.
  absl::StatusOr<pb::JobState> Describe(const std::string& job_id, absl::Time now) const;
  // Closes the job (phase CLOSED) with the reason as status_message.
  absl::StatusOr<pb::JobState> Close(const pb::CloseJobRequest& request, absl::Time now);

  // OK when the job does not exist, has no secret, or `secret` matches it;
  // PERMISSION_DENIED otherwise. Compared in constant time.
  absl::Status Authorize(const std::string& job_id, const std::string& secret) const;

  // ---- time

  // Applies every deadline at or before `now`: lapsed leases, last-call
  // windows, join timeouts, retention of finished jobs.
  void Tick(absl::Time now);
  // The earliest instant at which Tick would change something, or
  // absl::InfiniteFuture().
  absl::Time NextDeadline() const;

  // Jobs whose state or store changed since the last call (a job that was
  // dropped is included), each once. The service wakes their watchers and
  // waiters.
  std::vector<std::string> TakeChangedJobs();

  // True if durable state (anything in Snapshot) changed since the last
  // call. Lease renewals alone do not count.
  bool TakeDirty();

  // ---- persistence

  // Everything that must survive a server restart. Lease deadlines are not
  // saved: Restore grants every member now + lease_ttl, and restarts
  // last-call and join windows and finished jobs' retention from `now`.
  // Restore needs an empty machine (FAILED_PRECONDITION otherwise); an
  // inconsistent snapshot gets DATA_LOSS and leaves the machine empty. A
  // default-constructed ServerState restores to an empty machine.
  state::ServerState Snapshot(absl::Time now) const;
  absl::Status Restore(const state::ServerState& snapshot, absl::Time now);

  // Checks the invariants above; returns INTERNAL naming the first broken.
  absl::Status CheckInvariants(absl::Time now) const;

  size_t job_count() const;
  size_t member_count() const;  // across all jobs
  // What the job holds, as max_job_bytes counts it; NOT_FOUND if unknown.
  absl::StatusOr<size_t> JobBytes(const std::string& job_id) const;
  // JobBytes summed over every job (max_total_bytes); an upper bound on the
  // size of Snapshot's serialized form.
  size_t total_bytes() const;

 private:
  struct Impl;
  // Plain value semantics hidden behind a pointer so the header does not
  // leak the bookkeeping (and its includes) to the service.
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rdzv
