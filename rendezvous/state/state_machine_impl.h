// StateMachine's bookkeeping, shared by the state_machine_*.cc files. Not
// part of the interface: only the state machine's own sources include it.
//
// Indexes that keep every per-event operation O(log n) in the size of a job:
//   - lease_index: every lease that can lapse, ordered by deadline, so Tick
//     and NextDeadline look only at the front and KeepAlive moves one entry;
//   - job_deadlines: per job the earliest of its last-call, join-timeout and
//     retention deadlines (at most one entry per job);
//   - pending / waiting: join order, keyed by a per-job sequence number, so a
//     member leaves the queue in O(log n).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rendezvous/state/state_machine.h"

namespace muster::rdzv {

// The most recent failures a job remembers (JobState.failures).
inline constexpr size_t kMaxFailuresKept = 32;
// Free-text fields (failure messages, close reasons) are cut to this size.
inline constexpr size_t kMaxMessageBytes = 4096;
// The shortest lease_ttl a job may ask for; shorter ones cannot be renewed
// reliably over a network.
inline constexpr int64_t kMinLeaseTtlMs = 100;

struct MemberRecord {
  std::string id;
  std::string address;
  std::string hostname;
  uint32_t nproc = 1;
  int32_t requested_rank = -1;
  int32_t group_rank = -1;           // in the RUNNING/finished round, else -1
  uint32_t rank_offset = 0;          // valid when group_rank >= 0
  int32_t previous_group_rank = -1;  // rank in the round before
  bool done = false;

  enum class Queue { kNone, kPending, kWaiting };
  Queue queue = Queue::kNone;
  uint64_t queue_seq = 0;  // key in the job's pending/waiting map
  // A spare carried into a round that every member left (MEMBER_LEFT, a
  // preemption): it does not start the join timeout (JoinClockRuns).
  // Not persisted: after a restore it counts as a joiner.
  bool carried_spare = false;

  absl::Time lease_deadline;
  absl::Time last_renewal;
  bool in_lease_index = false;  // false once done, or the job finished
};

struct Job {
  std::string id;
  pb::JobConfig config;
  std::string secret_digest;  // SHA-256, empty when no secret
  pb::Phase phase = pb::GATHERING;
  uint64_t round = 0;
  uint64_t version = 1;

  absl::node_hash_map<std::string, MemberRecord> members;
  std::vector<std::string> round_members;           // group-rank order
  std::vector<std::string> previous_round_members;  // group-rank order
  std::map<uint64_t, std::string> pending;          // seq -> member, join order
  std::map<uint64_t, std::string> waiting;          // seq -> member, join order
  uint64_t next_queue_seq = 1;
  absl::flat_hash_map<int32_t, std::string> requested_ranks;  // rank -> member
  uint32_t world_size = 0;
  uint32_t nodes_done = 0;

  int32_t restart_count = 0;
  std::deque<pb::Failure> failures;
  std::string status_message;
  pb::RoundEndReason last_end_reason = pb::END_REASON_UNSPECIFIED;
  std::map<std::string, std::string> store;  // the current round's keys
  uint64_t next_member_number = 1;

  // What the job holds in the state file (StateMachine::JobBytes), in
  // three parts kept up to date by the Impl::Charge* helpers.
  size_t store_bytes = 0;   // StoreEntryBytes of every key
  size_t member_bytes = 0;  // MemberBytes of every member
  size_t record_bytes = 0;  // RecordBytes: ids, config, failures, status
  size_t bytes() const { return store_bytes + member_bytes + record_bytes; }

  // Time windows (not persisted; Restore restarts them).
  absl::Time gather_start;                               // gathering of `round` began
  std::optional<absl::Time> last_call_start;             // pending first reached min
  absl::Time finished_at;                                // phase became terminal
  std::optional<absl::Time> idle_since;                  // the last member went
  absl::Time indexed_deadline = absl::InfiniteFuture();  // in job_deadlines

  bool finished() const {
    return phase == pb::SUCCEEDED || phase == pb::FAILED || phase == pb::CLOSED;
  }
};

using LeaseKey = std::tuple<absl::Time, std::string, std::string>;  // job, member
using JobDeadlineKey = std::pair<absl::Time, std::string>;

struct StateMachine::Impl {
  explicit Impl(Limits limits_in) : limits(std::move(limits_in)) {}

  Limits limits;
  std::map<std::string, std::unique_ptr<Job>> jobs;  // ordered for ListJobs
  std::set<LeaseKey> lease_index;
  std::set<JobDeadlineKey> job_deadlines;
  size_t member_count = 0;
  size_t total_bytes = 0;  // Job::bytes() summed over `jobs`
  absl::flat_hash_set<std::string> changed_jobs;
  bool dirty = false;
  // The latest `now` Tick has applied: no indexed lease ends at or before it.
  absl::Time last_tick = absl::InfinitePast();

  // ---- bookkeeping (state_machine_rounds.cc)

  Job* FindJob(const std::string& job_id) const;
  // A durable change that watchers see: version++, changed, dirty.
  void MarkViewChanged(Job& job);
  // A durable change watchers do not see (membership, store): changed, dirty.
  void MarkDurableChanged(Job& job);
  void IndexLease(Job& job, MemberRecord& member);
  void UnindexLease(const Job& job, MemberRecord& member);
  void RenewLease(Job& job, MemberRecord& member, absl::Time now);
  // Recomputes the job's entry in job_deadlines; call after every change.
  void ReindexJob(Job& job);
  absl::Time JobDeadline(const Job& job) const;

  // Adds `member` to the back of the pending / waiting queue.
  void EnqueuePending(Job& job, MemberRecord& member);
  void EnqueueWaiting(Job& job, MemberRecord& member);
  void Dequeue(Job& job, MemberRecord& member);
  // Removes the member from the job entirely (queues, indexes, map).
  void RemoveMember(Job& job, const std::string& member_id);

  // Closes the gathered round if it may close, or fails the job on join
  // timeout. Idempotent; call after anything that could change either.
  void EvaluateGathering(Job& job, absl::Time now);
  void CloseRound(Job& job, absl::Time now);
  // The pending nodes in the order a round takes them: join order; under a
  // world_size_multiple, the previous round's nodes first, so a spare that
  // joined while they ran does not displace them.
  std::vector<std::string> GatherOrder(const Job& job) const;
  // How many of `order` (from the front) a round takes: at most max_nodes,
  // and under a world_size_multiple, the longest prefix whose nproc sum is
  // a multiple of it (0 if none is).
  size_t FittingNodes(const Job& job, const std::vector<std::string>& order) const;
  // FittingNodes of the pending nodes in GatherOrder.
  size_t FittingPending(const Job& job) const;
  // Whether the join timeout runs: a pending node waits that is not a spare
  // carried into a round every member left. Spares alone wait for the
  // preempted job's requeue with no deadline, as a job nobody waits for.
  bool JoinClockRuns(const Job& job) const;
  // Takes the members out of the RUNNING round (they remember their rank as
  // previous_group_rank) and clears the round's store.
  void ReleaseRoundMembers(Job& job, absl::Time now);
  // Ends the RUNNING round: store cleared, waiting members become pending
  // for round + 1, phase GATHERING.
  void EndRound(Job& job, pb::RoundEndReason reason, absl::Time now);
  // Ends the RUNNING round for a failure: records it and counts a restart.
  // Once restarts exceed max_restarts the job is FAILED at this round;
  // otherwise gathering of round + 1 starts (EndRound).
  // `permanent`: no restart can mend it (ReportFailureRequest.permanent),
  // so the job fails now, its budget untouched.
  void FailRound(Job& job, pb::RoundEndReason reason, pb::Failure failure, absl::Time now,
                 bool permanent = false);
  void FinishJob(Job& job, pb::Phase phase, std::string message, absl::Time now);
  void DropJob(const std::string& job_id);
  // A member's lease lapsed (Tick).
  void ExpireMember(Job& job, const std::string& member_id, absl::Time now);
  void TickUntil(absl::Time now);
  // The live member a KeepAlive or Leave names, after applying due
  // deadlines (so a lapsed lease is NOT_FOUND before the timer fires).
  absl::StatusOr<std::pair<Job*, MemberRecord*>> LiveMember(const std::string& job_id,
                                                            const std::string& member_id,
                                                            absl::Time now);

  // ---- byte accounting (state_machine_bytes.cc)

  // OK if the job (null: a job about to be created) may grow by `more`
  // bytes; RESOURCE_EXHAUSTED naming max_job_bytes or max_total_bytes
  // otherwise. Only growth is checked: a job over a lowered cap may keep
  // what it holds and shrink.
  absl::Status CheckGrowth(const Job* job, size_t more) const;
  // Writes `value` under `key` (creating it if max_keys_per_job and the
  // byte caps allow), keeping store_bytes current.
  absl::Status PutKey(Job& job, const std::string& key, std::string value);
  bool EraseKey(Job& job, const std::string& key);
  void ClearStore(Job& job);
  // Replaces the member's charge after its strings changed (or it was
  // created: a fresh member charges nothing yet).
  void RechargeMember(Job& job, const MemberRecord& member, size_t old_bytes);
  // Recomputes record_bytes after failures or status_message changed.
  void RechargeRecord(Job& job);
  // Charges a job that was just placed in `jobs` / uncharges one leaving.
  void ChargeJob(Job& job);
  void UnchargeJob(const Job& job);

  // ---- persistence (state_machine_persist.cc)

  // Rebuilds one job from its record; DATA_LOSS on any inconsistency.
  absl::Status RestoreJob(const state::JobRecord& record, absl::Time now);

  // ---- views (state_machine_view.cc)

  pb::JobState BuildState(const Job& job) const;
  void FillMember(const Job& job, const MemberRecord& member, pb::Member* out) const;

  // ---- fencing (state_machine_validate.cc)

  // The job for a round-scoped call: NOT_FOUND, ABORTED for an old round,
  // FAILED_PRECONDITION for a finished job, a future round or a round that
  // is not RUNNING.
  absl::StatusOr<Job*> FenceRound(const std::string& job_id, uint64_t round) const;
  // FAILED_PRECONDITION unless `member_id` is in the job's current round.
  absl::StatusOr<MemberRecord*> RoundMember(Job& job, const std::string& member_id) const;
};

// ---- byte accounting (state_machine_bytes.cc): upper bounds on what each
// part takes in the serialized snapshot (tags and lengths included).

size_t StoreEntryBytes(const std::string& key, const std::string& value);
size_t MemberBytes(const MemberRecord& member);
size_t RecordBytes(const Job& job);
size_t CountStoreBytes(const Job& job);   // what store_bytes should be
size_t CountMemberBytes(const Job& job);  // what member_bytes should be
// Sets all three parts from scratch (Restore, a new job).
void CountJobBytes(Job& job);

// ---- validation helpers (state_machine_validate.cc)

absl::Status ValidateId(const char* field, const std::string& id, const Limits& limits);
absl::Status ValidateJobConfig(const pb::JobConfig& config);
// INVALID_ARGUMENT when a new job asks for a join_timeout_ms over the cap.
absl::Status CheckJoinTimeout(const pb::JobConfig& config, const Limits& limits);
absl::Status CheckSameConfig(const std::string& job_id, const pb::JobConfig& job_config,
                             const pb::JobConfig& requested);
absl::Status ValidateKey(const std::string& key, const Limits& limits);
absl::Status ValidateValue(const std::string& value, const Limits& limits);
// FAILED_PRECONDITION: `job "j1" is closed (succeeded at round 3)`.
absl::Status JobClosedError(const Job& job);
std::string Sha256(const std::string& data);
bool DigestsEqual(const std::string& a, const std::string& b);
std::string Truncate(const std::string& text, size_t max_bytes);
// A server-generated member id: "<hostname or node>-<number>", made valid.
std::string MakeMemberId(const std::string& hostname, uint64_t number, const Limits& limits);

}  // namespace muster::rdzv
