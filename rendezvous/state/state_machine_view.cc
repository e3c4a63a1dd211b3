// Read-only views: JobState (what Watch streams), Describe, ListJobs, and
// the invariant check the tests run after every event.
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

void StateMachine::Impl::FillMember(const Job& job, const MemberRecord& member,
                                    pb::Member* out) const {
  out->set_member_id(member.id);
  out->set_address(member.address);
  out->set_hostname(member.hostname);
  out->set_nproc(member.nproc);
  out->set_group_rank(member.group_rank);
  out->set_rank_offset(member.rank_offset);
}

pb::JobState StateMachine::Impl::BuildState(const Job& job) const {
  pb::JobState state;
  state.set_job_id(job.id);
  state.set_version(job.version);
  *state.mutable_config() = job.config;
  state.set_phase(job.phase);
  state.set_round(job.round);
  state.mutable_members()->Reserve(job.round_members.size());
  for (const std::string& id : job.round_members) {
    FillMember(job, job.members.at(id), state.add_members());
  }
  state.set_world_size(job.world_size);
  state.set_nodes_waiting(job.waiting.size());
  state.set_nodes_pending(job.pending.size());
  state.set_restart_count(job.restart_count);
  state.set_last_end_reason(job.last_end_reason);
  for (const pb::Failure& failure : job.failures) {
    *state.add_failures() = failure;
  }
  state.set_status_message(job.status_message);
  state.set_nodes_done(job.nodes_done);
  if (job.phase == pb::RUNNING && !job.waiting.empty()) {
    // The next round's order when every member comes back: they first
    // (GatherOrder puts the previous round first), then the spares.
    std::vector<std::string> order = job.round_members;
    for (const auto& [seq, id] : job.waiting) order.push_back(id);
    const size_t fitting = FittingNodes(job, order);
    const size_t running = job.round_members.size();
    state.set_nodes_admittable(fitting > running ? fitting - running : 0);
  }
  return state;
}

absl::StatusOr<pb::JobState> StateMachine::State(const std::string& job_id) const {
  const Job* job = impl_->FindJob(job_id);
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
  }
  return impl_->BuildState(*job);
}

absl::StatusOr<uint64_t> StateMachine::Version(const std::string& job_id) const {
  const Job* job = impl_->FindJob(job_id);
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
  }
  return job->version;
}

absl::StatusOr<pb::JobState> StateMachine::Describe(const std::string& job_id,
                                                    absl::Time now) const {
  const Impl& s = *impl_;
  const Job* job = s.FindJob(job_id);
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
  }
  pb::JobState state = s.BuildState(*job);
  auto lease_age_ms = [&](const std::string& id) {
    return absl::ToInt64Milliseconds(now - job->members.at(id).last_renewal);
  };
  for (pb::Member& member : *state.mutable_members()) {
    member.set_lease_age_ms(lease_age_ms(member.member_id()));
  }
  // Pending first (they are closer to running), then waiting; join order.
  for (const auto* queue : {&job->pending, &job->waiting}) {
    for (const auto& [seq, id] : *queue) {
      pb::Member* out = state.add_waiting();
      s.FillMember(*job, job->members.at(id), out);
      out->set_lease_age_ms(lease_age_ms(id));
    }
  }
  return state;
}

pb::ListJobsResponse StateMachine::ListJobs() const {
  pb::ListJobsResponse response;
  for (const auto& [id, job] : impl_->jobs) {
    pb::JobSummary* summary = response.add_jobs();
    summary->set_job_id(id);
    summary->set_phase(job->phase);
    summary->set_round(job->round);
    // While a round gathers it has no members yet; show how many joined.
    summary->set_nodes(job->phase == pb::GATHERING ? job->pending.size()
                                                   : job->round_members.size());
    summary->set_world_size(job->world_size);
    summary->set_nodes_waiting(job->waiting.size());
    summary->set_restart_count(job->restart_count);
    summary->set_max_restarts(job->config.max_restarts());
  }
  return response;
}

namespace {

absl::Status Broken(const Job& job, const std::string& what) {
  return absl::InternalError(absl::StrFormat("invariant broken in job %s: %s", job.id, what));
}

}  // namespace

absl::Status StateMachine::CheckInvariants(absl::Time now) const {
  const Impl& s = *impl_;
  size_t members = 0;
  size_t leases = 0;
  size_t total_bytes = 0;
  for (const auto& [job_id, job_ptr] : s.jobs) {
    const Job& job = *job_ptr;
    members += job.members.size();
    const size_t n = job.round_members.size();
    if (job.phase == pb::RUNNING) {
      if (n < job.config.min_nodes() || n > job.config.max_nodes()) {
        return Broken(job, absl::StrFormat("RUNNING with %d nodes; min %d max %d", n,
                                           job.config.min_nodes(), job.config.max_nodes()));
      }
      if (!job.pending.empty()) return Broken(job, "RUNNING with pending");
      if (job.config.world_size_multiple() > 1 &&
          job.world_size % job.config.world_size_multiple() != 0) {
        return Broken(job, absl::StrFormat("RUNNING with world %d; world_size_multiple %d",
                                           job.world_size, job.config.world_size_multiple()));
      }
    }
    if (job.phase == pb::GATHERING && (n != 0 || !job.waiting.empty())) {
      return Broken(job, "GATHERING with round members or waiting nodes");
    }
    // Ranks unique and 0..n-1 in order; offsets are prefix sums of nproc.
    uint32_t offset = 0;
    size_t done = 0;
    for (size_t rank = 0; rank < n; ++rank) {
      auto it = job.members.find(job.round_members[rank]);
      if (it == job.members.end()) return Broken(job, "round member missing");
      const MemberRecord& member = it->second;
      if (member.group_rank != static_cast<int32_t>(rank) || member.rank_offset != offset) {
        return Broken(
            job, absl::StrFormat("member %s at rank %d has group_rank %d, "
                                 "rank_offset %d (expected %d)",
                                 member.id, rank, member.group_rank, member.rank_offset, offset));
      }
      if (member.queue != MemberRecord::Queue::kNone) {
        return Broken(job, "round member " + member.id + " is also queued");
      }
      offset += member.nproc;
      done += member.done ? 1 : 0;
    }
    if (offset != job.world_size) return Broken(job, "world_size mismatch");
    if (done != job.nodes_done) return Broken(job, "nodes_done mismatch");
    size_t in_rounds = 0;
    for (const auto& [id, member] : job.members) {
      if (member.id != id) return Broken(job, "member id mismatch");
      if (member.group_rank >= 0) ++in_rounds;
      const auto* queue = member.queue == MemberRecord::Queue::kPending   ? &job.pending
                          : member.queue == MemberRecord::Queue::kWaiting ? &job.waiting
                                                                          : nullptr;
      if (queue != nullptr) {
        auto entry = queue->find(member.queue_seq);
        if (entry == queue->end() || entry->second != id) {
          return Broken(job, "member " + id + " missing from its queue");
        }
      }
      bool should_index = !job.finished() && !member.done;
      if (member.in_lease_index != should_index) {
        return Broken(job, "member " + id + " lease indexing is wrong");
      }
      if (member.in_lease_index) {
        ++leases;
        if (s.lease_index.count(LeaseKey(member.lease_deadline, job.id, id)) == 0) {
          return Broken(job, "member " + id + " missing from lease index");
        }
        if (member.lease_deadline <= s.last_tick) {
          return Broken(job, "member " + id + " outlived its lease past Tick");
        }
      }
      if (member.requested_rank >= 0 && job.requested_ranks.at(member.requested_rank) != id) {
        return Broken(job, "requested rank of " + id + " not unique");
      }
    }
    if (in_rounds != n) return Broken(job, "stray group_rank");
    if (job.pending.size() + job.waiting.size() > job.members.size()) {
      return Broken(job, "queues larger than the member set");
    }
    // Caps bound growth only (a restore may hold more), so the check is
    // that the byte accounting matches a recount.
    if (CountStoreBytes(job) != job.store_bytes || CountMemberBytes(job) != job.member_bytes ||
        RecordBytes(job) != job.record_bytes) {
      return Broken(job, "byte accounting does not match a recount");
    }
    total_bytes += job.bytes();
    if (job.failures.size() > kMaxFailuresKept) {
      return Broken(job, "too many failures kept");
    }
    if (job.indexed_deadline != s.JobDeadline(job)) {
      return Broken(job, "job deadline index is stale");
    }
  }
  if (members != s.member_count) {
    return absl::InternalError("member_count does not match the jobs");
  }
  if (total_bytes != s.total_bytes) {
    return absl::InternalError("total_bytes does not match the jobs");
  }
  if (leases != s.lease_index.size()) {
    return absl::InternalError("lease index has stale entries");
  }
  return absl::OkStatus();
}

}  // namespace muster::rdzv
