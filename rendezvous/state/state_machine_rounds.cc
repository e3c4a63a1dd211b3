// Rounds: gathering, closing (rank assignment), ending, restarts, leases and
// the deadline indexes behind Tick.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

Job* StateMachine::Impl::FindJob(const std::string& job_id) const {
  auto it = jobs.find(job_id);
  return it == jobs.end() ? nullptr : it->second.get();
}

void StateMachine::Impl::MarkViewChanged(Job& job) {
  ++job.version;
  MarkDurableChanged(job);
}

void StateMachine::Impl::MarkDurableChanged(Job& job) {
  changed_jobs.insert(job.id);
  dirty = true;
}

void StateMachine::Impl::IndexLease(Job& job, MemberRecord& member) {
  if (member.in_lease_index) return;
  lease_index.emplace(member.lease_deadline, job.id, member.id);
  member.in_lease_index = true;
}

void StateMachine::Impl::UnindexLease(const Job& job, MemberRecord& member) {
  if (!member.in_lease_index) return;
  lease_index.erase(LeaseKey(member.lease_deadline, job.id, member.id));
  member.in_lease_index = false;
}

void StateMachine::Impl::RenewLease(Job& job, MemberRecord& member, absl::Time now) {
  // A done member or one of a finished job is not indexed: it may exit.
  bool indexed = member.in_lease_index;
  UnindexLease(job, member);
  member.last_renewal = now;
  member.lease_deadline = now + absl::Milliseconds(job.config.lease_ttl_ms());
  if (indexed || (!member.done && !job.finished())) IndexLease(job, member);
}

absl::Time StateMachine::Impl::JobDeadline(const Job& job) const {
  if (job.finished()) return job.finished_at + limits.closed_retention;
  if (job.idle_since) return *job.idle_since + limits.idle_retention;
  if (job.phase != pb::GATHERING) return absl::InfiniteFuture();
  if (job.last_call_start && FittingPending(job) >= job.config.min_nodes()) {
    return *job.last_call_start + absl::Milliseconds(job.config.last_call_timeout_ms());
  }
  if (!JoinClockRuns(job)) return absl::InfiniteFuture();  // nobody waits: no join timeout
  return job.gather_start + absl::Milliseconds(job.config.join_timeout_ms());
}

void StateMachine::Impl::ReindexJob(Job& job) {
  absl::Time deadline = JobDeadline(job);
  if (deadline == job.indexed_deadline) return;
  if (job.indexed_deadline != absl::InfiniteFuture()) {
    job_deadlines.erase(JobDeadlineKey(job.indexed_deadline, job.id));
  }
  if (deadline != absl::InfiniteFuture()) {
    job_deadlines.emplace(deadline, job.id);
  }
  job.indexed_deadline = deadline;
}

void StateMachine::Impl::EnqueuePending(Job& job, MemberRecord& member) {
  Dequeue(job, member);
  member.queue = MemberRecord::Queue::kPending;
  member.queue_seq = job.next_queue_seq++;
  job.pending.emplace(member.queue_seq, member.id);
}

void StateMachine::Impl::EnqueueWaiting(Job& job, MemberRecord& member) {
  Dequeue(job, member);
  member.queue = MemberRecord::Queue::kWaiting;
  member.queue_seq = job.next_queue_seq++;
  job.waiting.emplace(member.queue_seq, member.id);
}

void StateMachine::Impl::Dequeue(Job& job, MemberRecord& member) {
  if (member.queue == MemberRecord::Queue::kPending) {
    job.pending.erase(member.queue_seq);
  } else if (member.queue == MemberRecord::Queue::kWaiting) {
    job.waiting.erase(member.queue_seq);
  }
  member.queue = MemberRecord::Queue::kNone;
}

void StateMachine::Impl::RemoveMember(Job& job, const std::string& member_id) {
  auto it = job.members.find(member_id);
  if (it == job.members.end()) return;
  MemberRecord& member = it->second;
  UnindexLease(job, member);
  Dequeue(job, member);
  auto requested = job.requested_ranks.find(member.requested_rank);
  if (requested != job.requested_ranks.end() && requested->second == member_id) {
    job.requested_ranks.erase(requested);
  }
  auto& previous = job.previous_round_members;
  previous.erase(std::remove(previous.begin(), previous.end(), member_id), previous.end());
  const size_t bytes = MemberBytes(member);
  job.member_bytes -= bytes;
  total_bytes -= bytes;
  job.members.erase(it);
  --member_count;
  MarkDurableChanged(job);
}

std::vector<std::string> StateMachine::Impl::GatherOrder(const Job& job) const {
  std::vector<std::string> order;
  order.reserve(job.pending.size());
  if (job.config.world_size_multiple() > 1) {
    for (const std::string& id : job.previous_round_members) {
      auto it = job.members.find(id);
      if (it != job.members.end() && it->second.queue == MemberRecord::Queue::kPending) {
        order.push_back(id);
      }
    }
  }
  const absl::flat_hash_set<std::string> first(order.begin(), order.end());
  for (const auto& [seq, id] : job.pending) {
    if (!first.contains(id)) order.push_back(id);
  }
  return order;
}

size_t StateMachine::Impl::FittingPending(const Job& job) const {
  // Every change of a job asks this: without a multiple, the count alone
  // answers, with no order to build.
  if (job.config.world_size_multiple() <= 1) {
    return std::min<size_t>(job.pending.size(), job.config.max_nodes());
  }
  return FittingNodes(job, GatherOrder(job));
}

bool StateMachine::Impl::JoinClockRuns(const Job& job) const {
  for (const auto& [seq, id] : job.pending) {
    if (!job.members.at(id).carried_spare) return true;
  }
  return false;
}

size_t StateMachine::Impl::FittingNodes(const Job& job,
                                        const std::vector<std::string>& order) const {
  const size_t cap = std::min<size_t>(order.size(), job.config.max_nodes());
  const uint64_t multiple = job.config.world_size_multiple();
  if (multiple <= 1) return cap;
  size_t fitting = 0;
  uint64_t world = 0;
  for (size_t n = 1; n <= cap; ++n) {
    world += job.members.at(order[n - 1]).nproc;
    if (world % multiple == 0) fitting = n;
  }
  return fitting;
}

void StateMachine::Impl::EvaluateGathering(Job& job, absl::Time now) {
  // Called after every change of membership, so it is where the job
  // notices it has none left (or again has some).
  if (job.members.empty() && !job.finished()) {
    if (!job.idle_since) job.idle_since = now;
  } else {
    job.idle_since.reset();
  }
  if (job.phase == pb::GATHERING) {
    const size_t pending = job.pending.size();
    const size_t min_nodes = job.config.min_nodes();
    // Under a world_size_multiple only the nodes that make a fitting world
    // count towards min_nodes; without one, every pending node does.
    const size_t fitting = FittingPending(job);
    if (fitting >= min_nodes && !job.last_call_start) {
      // The window starts the first time min is reached in this round and is
      // not restarted if the count dips below min and recovers.
      job.last_call_start = now;
    }
    bool last_call_over =
        job.last_call_start &&
        now >= *job.last_call_start + absl::Milliseconds(job.config.last_call_timeout_ms());
    // After a restart nobody beyond the job's live members is expected, so
    // once all of them are back there is no point waiting out last call.
    bool everyone_back = job.round > 0 && pending == job.members.size();
    if (fitting >= min_nodes &&
        (pending >= job.config.max_nodes() || last_call_over || everyone_back)) {
      CloseRound(job, now);
    } else if (JoinClockRuns(job) && fitting < min_nodes &&
               // Like every deadline, it applies at the instant it is reached.
               now >= job.gather_start + absl::Milliseconds(job.config.join_timeout_ms())) {
      std::string message =
          pending < min_nodes
              ? absl::StrFormat(
                    "join timeout: only %d of min_nodes %d nodes joined round %d "
                    "within %d ms",
                    pending, min_nodes, job.round, job.config.join_timeout_ms())
              : absl::StrFormat(
                    "join timeout: %d nodes joined round %d within %d ms, but taken in "
                    "order (the previous round's first, then by join time), no "
                    "first %d to %d of them make a world that is a multiple of "
                    "world_size_multiple %d",
                    pending, job.round, job.config.join_timeout_ms(), min_nodes,
                    job.config.max_nodes(), job.config.world_size_multiple());
      FinishJob(job, pb::FAILED, std::move(message), now);
    }
  }
  ReindexJob(job);
}

void StateMachine::Impl::CloseRound(Job& job, absl::Time now) {
  // The first max_nodes joiners (GatherOrder), or as many of them as make
  // a fitting world, form the round; the others stay as spares.
  std::vector<std::string> selected = GatherOrder(job);
  selected.resize(FittingNodes(job, selected));
  const absl::flat_hash_set<std::string> taken(selected.begin(), selected.end());
  std::map<uint64_t, std::string> spares;
  for (auto& [seq, id] : job.pending) {
    job.members.at(id).carried_spare = false;
    if (taken.contains(id)) {
      job.members.at(id).queue = MemberRecord::Queue::kNone;
    } else {
      spares.emplace(seq, id);
      job.members.at(id).queue = MemberRecord::Queue::kWaiting;
    }
  }
  job.pending.clear();
  job.waiting.insert(spares.begin(), spares.end());

  // Rank order: requested ranks where they fit in 0..n-1; then, filling the
  // remaining slots in order, requesters whose rank did not fit (by requested
  // rank), survivors of the previous round (previous order), and newcomers
  // (join order). So ranks are always 0..n-1 and requests are honoured
  // whenever they can be.
  const size_t n = selected.size();
  std::vector<const std::string*> slots(n, nullptr);
  absl::flat_hash_set<std::string> placed;
  std::vector<std::pair<int32_t, const std::string*>> unfit_requests;
  for (const std::string& id : selected) {
    int32_t requested = job.members.at(id).requested_rank;
    if (requested < 0) continue;
    if (static_cast<size_t>(requested) < n && slots[requested] == nullptr) {
      slots[requested] = &id;
    } else {
      unfit_requests.emplace_back(requested, &id);
    }
    placed.insert(id);
  }
  std::sort(unfit_requests.begin(), unfit_requests.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<const std::string*> fill_order;
  for (auto& [rank, id] : unfit_requests) fill_order.push_back(id);
  absl::flat_hash_set<std::string> chosen(selected.begin(), selected.end());
  for (const std::string& id : job.previous_round_members) {
    if (chosen.contains(id) && placed.insert(id).second) {
      fill_order.push_back(&id);
    }
  }
  for (const std::string& id : selected) {
    if (placed.insert(id).second) fill_order.push_back(&id);
  }
  size_t next_fill = 0;
  for (auto& slot : slots) {
    if (slot == nullptr) slot = fill_order[next_fill++];
  }

  job.round_members.clear();
  job.round_members.reserve(n);
  uint32_t offset = 0;
  for (size_t rank = 0; rank < n; ++rank) {
    MemberRecord& member = job.members.at(*slots[rank]);
    member.group_rank = static_cast<int32_t>(rank);
    member.rank_offset = offset;
    member.done = false;
    offset += member.nproc;
    job.round_members.push_back(member.id);
  }
  job.world_size = offset;
  job.nodes_done = 0;
  job.phase = pb::RUNNING;
  job.last_call_start.reset();
  ClearStore(job);
  MarkViewChanged(job);
  ReindexJob(job);
}

void StateMachine::Impl::ReleaseRoundMembers(Job& job, absl::Time now) {
  for (const std::string& id : job.previous_round_members) {
    auto it = job.members.find(id);
    if (it != job.members.end()) it->second.previous_group_rank = -1;
  }
  for (const std::string& id : job.round_members) {
    MemberRecord& member = job.members.at(id);
    member.previous_group_rank = member.group_rank;
    member.group_rank = -1;
    member.rank_offset = 0;
    if (member.done) {
      // A done member was allowed to exit; give it one ttl to re-join, then
      // its lease lapses like anyone's.
      member.done = false;
      member.lease_deadline = now + absl::Milliseconds(job.config.lease_ttl_ms());
      if (!job.finished()) IndexLease(job, member);
    }
  }
  job.previous_round_members = std::move(job.round_members);
  job.round_members.clear();
  job.world_size = 0;
  job.nodes_done = 0;
  ClearStore(job);
}

void StateMachine::Impl::EndRound(Job& job, pb::RoundEndReason reason, absl::Time now) {
  ReleaseRoundMembers(job, now);
  job.last_end_reason = reason;
  job.round += 1;
  job.phase = pb::GATHERING;
  job.gather_start = now;
  job.last_call_start.reset();
  // Waiting members are pending for the new round, in their join order.
  // When the round ended because a member left (a preemption), they are
  // carried spares: if every member left, only a requeue can go on, and
  // they alone do not start the join timeout.
  for (auto& [seq, id] : job.waiting) {
    MemberRecord& member = job.members.at(id);
    member.queue = MemberRecord::Queue::kPending;
    member.carried_spare = reason == pb::MEMBER_LEFT;
  }
  job.pending = std::move(job.waiting);
  job.waiting.clear();
  MarkViewChanged(job);
}

void StateMachine::Impl::FailRound(Job& job, pb::RoundEndReason reason, pb::Failure failure,
                                   absl::Time now, bool permanent) {
  // The node's rank and host first: a member id ("vm-1") reads as node 1
  // of host vm, which it need not be.
  std::string description;
  auto member = job.members.find(failure.member_id());
  if (member != job.members.end() && member->second.group_rank >= 0) {
    description = absl::StrFormat("node %d (host %s, member %s) in round %d: exit code %d",
                                  member->second.group_rank, member->second.hostname,
                                  failure.member_id(), failure.round(), failure.exit_code());
  } else {
    description = absl::StrFormat("member %s in round %d: exit code %d", failure.member_id(),
                                  failure.round(), failure.exit_code());
  }
  if (!failure.message().empty()) absl::StrAppend(&description, ": ", failure.message());
  job.failures.push_back(std::move(failure));
  while (job.failures.size() > kMaxFailuresKept) job.failures.pop_front();
  RechargeRecord(job);
  if (permanent) {
    ReleaseRoundMembers(job, now);
    job.last_end_reason = reason;
    FinishJob(job, pb::FAILED,
              absl::StrFormat("failed without a restart (%d of %d used), since no restart can "
                              "mend this failure: %s",
                              job.restart_count, job.config.max_restarts(), description),
              now);
    return;
  }
  job.restart_count += 1;
  if (job.restart_count <= job.config.max_restarts()) {
    EndRound(job, reason, now);
    return;
  }
  // The job fails in the round that failed: no new round starts.
  ReleaseRoundMembers(job, now);
  job.last_end_reason = reason;
  FinishJob(job, pb::FAILED,
            absl::StrFormat("restart budget of %d spent; last failure: %s",
                            job.config.max_restarts(), description),
            now);
}

void StateMachine::Impl::FinishJob(Job& job, pb::Phase phase, std::string message, absl::Time now) {
  job.phase = phase;
  job.status_message = std::move(message);
  RechargeRecord(job);
  job.finished_at = now;
  job.last_call_start.reset();
  ClearStore(job);
  // Nobody's lease matters any more; agents learn the outcome and exit.
  for (auto& [id, member] : job.members) UnindexLease(job, member);
  MarkViewChanged(job);
  ReindexJob(job);
}

void StateMachine::Impl::DropJob(const std::string& job_id) {
  auto it = jobs.find(job_id);
  if (it == jobs.end()) return;
  Job& job = *it->second;
  for (auto& [id, member] : job.members) UnindexLease(job, member);
  if (job.indexed_deadline != absl::InfiniteFuture()) {
    job_deadlines.erase(JobDeadlineKey(job.indexed_deadline, job.id));
  }
  member_count -= job.members.size();
  UnchargeJob(job);
  changed_jobs.insert(job_id);
  dirty = true;
  jobs.erase(it);
}

void StateMachine::Impl::ExpireMember(Job& job, const std::string& member_id, absl::Time now) {
  MemberRecord& member = job.members.at(member_id);
  if (member.group_rank >= 0 && job.phase == pb::RUNNING) {
    pb::Failure failure;
    failure.set_member_id(member_id);
    failure.set_round(job.round);
    failure.set_exit_code(-1);
    failure.set_message(absl::StrCat("lease of ", member_id, " expired"));
    FailRound(job, pb::MEMBER_LOST, std::move(failure), now);
    RemoveMember(job, member_id);
  } else {
    bool queued = member.queue != MemberRecord::Queue::kNone;
    RemoveMember(job, member_id);
    if (queued) MarkViewChanged(job);
  }
  EvaluateGathering(job, now);
}

void StateMachine::Impl::TickUntil(absl::Time now) {
  while (true) {
    absl::Time lease_top =
        lease_index.empty() ? absl::InfiniteFuture() : std::get<0>(*lease_index.begin());
    absl::Time job_top =
        job_deadlines.empty() ? absl::InfiniteFuture() : job_deadlines.begin()->first;
    if (std::min(lease_top, job_top) > now) break;
    // Deadlines are applied in time order, leases first on a tie.
    if (lease_top <= job_top) {
      LeaseKey key = *lease_index.begin();
      Job* job = FindJob(std::get<1>(key));
      if (job == nullptr || !job->members.contains(std::get<2>(key))) {
        lease_index.erase(lease_index.begin());  // stale; cannot happen
        continue;
      }
      ExpireMember(*job, std::get<2>(key), now);
    } else {
      JobDeadlineKey key = *job_deadlines.begin();
      Job* job = FindJob(key.second);
      if (job == nullptr) {
        job_deadlines.erase(job_deadlines.begin());  // stale; cannot happen
        continue;
      }
      if (job->finished() || (job->idle_since && job->members.empty())) {
        // Retention over: a finished job's, or an idle one's.
        DropJob(key.second);
        continue;
      }
      EvaluateGathering(*job, now);
      if (job->indexed_deadline == key.first) {
        // No progress would loop forever; every deadline <= now makes the
        // job close or fail above, so this is a bug guard only.
        job_deadlines.erase(key);
        job->indexed_deadline = absl::InfiniteFuture();
      }
    }
  }
  last_tick = std::max(last_tick, now);
}

}  // namespace muster::rdzv
