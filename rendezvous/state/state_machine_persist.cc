// Snapshot and Restore (rendezvous/state/state.proto).
//
// Restore trusts nothing: it rebuilds the bookkeeping from the records,
// checks every cross-reference, then runs CheckInvariants. Any failure
// leaves the machine empty and returns DATA_LOSS.
//
// Limits are not checked here: the state was accepted under the limits of
// the server that wrote it, and an operator may have lowered them since.
// Restore keeps such jobs; the caps then refuse only growth.
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

namespace {

constexpr uint32_t kFormatVersion = 1;

void SaveJob(const Job& job, state::JobRecord* record) {
  record->set_job_id(job.id);
  *record->mutable_config() = job.config;
  record->set_secret_sha256(job.secret_digest);
  record->set_phase(job.phase);
  record->set_round(job.round);
  record->set_version(job.version);
  // Members in a stable order so equal states give equal snapshots.
  std::map<std::string, const MemberRecord*> members;
  for (const auto& [id, member] : job.members) members.emplace(id, &member);
  for (const auto& [id, member] : members) {
    state::MemberRecord* out = record->add_members();
    out->set_member_id(id);
    out->set_address(member->address);
    out->set_hostname(member->hostname);
    out->set_nproc(member->nproc);
    out->set_requested_rank(member->requested_rank);
    out->set_group_rank(member->group_rank);
    out->set_done(member->done);
    out->set_previous_group_rank(member->previous_group_rank);
  }
  for (const std::string& id : job.round_members) record->add_round_members(id);
  for (const auto& [seq, id] : job.pending) record->add_pending(id);
  for (const auto& [seq, id] : job.waiting) record->add_waiting(id);
  record->set_restart_count(job.restart_count);
  for (const pb::Failure& failure : job.failures) {
    *record->add_failures() = failure;
  }
  record->set_status_message(job.status_message);
  record->set_last_end_reason(job.last_end_reason);
  for (const auto& [key, value] : job.store) {
    state::StoreEntry* entry = record->add_store();
    entry->set_key(key);
    entry->set_value(value);
  }
  record->set_next_member_number(job.next_member_number);
  for (const std::string& id : job.previous_round_members) {
    record->add_previous_round_members(id);
  }
}

absl::Status Bad(const std::string& job_id, const std::string& what) {
  return absl::DataLossError(
      absl::StrFormat("snapshot of job \"%s\" is invalid: %s", job_id, what));
}

}  // namespace

state::ServerState StateMachine::Snapshot(absl::Time /*now*/) const {
  state::ServerState snapshot;
  snapshot.set_format_version(kFormatVersion);
  for (const auto& [id, job] : impl_->jobs) SaveJob(*job, snapshot.add_jobs());
  return snapshot;
}

absl::Status StateMachine::Impl::RestoreJob(const state::JobRecord& record, absl::Time now) {
  Impl& s = *this;
  const std::string& job_id = record.job_id();
  // Well-formed whatever their size: limits bound growth, not the past.
  Limits any_size = s.limits;
  any_size.max_id_bytes = std::numeric_limits<size_t>::max();
  any_size.max_key_bytes = std::numeric_limits<size_t>::max();
  if (!ValidateId("job_id", job_id, any_size).ok()) return Bad(job_id, "id");
  if (s.jobs.count(job_id) > 0) return Bad(job_id, "listed twice");
  const pb::JobConfig& config = record.config();
  if (auto status = ValidateJobConfig(config); !status.ok()) {
    return Bad(job_id, std::string(status.message()));
  }
  if (record.phase() < pb::GATHERING || record.phase() > pb::CLOSED) {
    return Bad(job_id, "phase");
  }
  if (!pb::RoundEndReason_IsValid(record.last_end_reason())) {
    return Bad(job_id, "last_end_reason");
  }
  if (!record.secret_sha256().empty() && record.secret_sha256().size() != 32) {
    return Bad(job_id, "secret digest is not SHA-256");
  }
  if (record.failures_size() > static_cast<int>(kMaxFailuresKept) || record.restart_count() < 0) {
    return Bad(job_id, "failures or restart count out of range");
  }
  auto owned = std::make_unique<Job>();
  Job& job = *owned;
  job.id = job_id;
  job.config = config;
  job.secret_digest = record.secret_sha256();
  job.phase = static_cast<pb::Phase>(record.phase());
  job.round = record.round();
  job.version = std::max<uint64_t>(record.version(), 1);
  job.restart_count = record.restart_count();
  for (const pb::Failure& failure : record.failures()) {
    job.failures.push_back(failure);
  }
  job.status_message = record.status_message();
  job.last_end_reason = static_cast<pb::RoundEndReason>(record.last_end_reason());
  job.next_member_number = record.next_member_number();
  for (const state::StoreEntry& entry : record.store()) {
    if (!ValidateKey(entry.key(), any_size).ok() ||
        !job.store.emplace(entry.key(), entry.value()).second) {
      return Bad(job_id, "store entry");
    }
  }
  for (const state::MemberRecord& saved : record.members()) {
    const std::string& id = saved.member_id();
    if (!ValidateId("member_id", id, any_size).ok() || saved.nproc() < 1 ||
        saved.requested_rank() < -1 ||
        (saved.requested_rank() >= 0 &&
         static_cast<uint32_t>(saved.requested_rank()) >= job.config.max_nodes())) {
      return Bad(job_id, "member " + id);
    }
    MemberRecord& member = job.members[id];
    if (!member.id.empty()) return Bad(job_id, "member listed twice: " + id);
    member.id = id;
    member.address = saved.address();
    member.hostname = saved.hostname();
    member.nproc = saved.nproc();
    member.requested_rank = saved.requested_rank();
    member.previous_group_rank = saved.previous_group_rank();
    member.done = saved.done();
    member.last_renewal = now;
    member.lease_deadline = now + absl::Milliseconds(job.config.lease_ttl_ms());
    if (member.requested_rank >= 0 &&
        !job.requested_ranks.emplace(member.requested_rank, id).second) {
      return Bad(job_id, "requested rank claimed twice");
    }
  }
  auto find = [&](const std::string& id) -> MemberRecord* {
    auto it = job.members.find(id);
    return it == job.members.end() ? nullptr : &it->second;
  };
  uint32_t offset = 0;
  for (const std::string& id : record.round_members()) {
    MemberRecord* member = find(id);
    if (member == nullptr || member->group_rank >= 0) {
      return Bad(job_id, "round member " + id);
    }
    member->group_rank = static_cast<int32_t>(job.round_members.size());
    member->rank_offset = offset;
    offset += member->nproc;
    job.nodes_done += member->done ? 1 : 0;
    job.round_members.push_back(id);
  }
  job.world_size = offset;
  for (const state::MemberRecord& saved : record.members()) {
    if (saved.group_rank() != job.members.at(saved.member_id()).group_rank ||
        (saved.done() && saved.group_rank() < 0)) {
      return Bad(job_id, "group rank of " + saved.member_id());
    }
  }
  for (const auto& [ids, is_pending] :
       {std::pair(&record.pending(), true), std::pair(&record.waiting(), false)}) {
    for (const std::string& id : *ids) {
      MemberRecord* member = find(id);
      if (member == nullptr || member->group_rank >= 0 ||
          member->queue != MemberRecord::Queue::kNone) {
        return Bad(job_id, "queued member " + id);
      }
      if (is_pending) {
        s.EnqueuePending(job, *member);
      } else {
        s.EnqueueWaiting(job, *member);
      }
    }
  }
  for (const std::string& id : record.previous_round_members()) {
    if (find(id) == nullptr) return Bad(job_id, "previous member " + id);
    job.previous_round_members.push_back(id);
  }
  // Every window restarts at `now`: the old clock's instants mean nothing.
  job.gather_start = now;
  if (job.pending.size() >= job.config.min_nodes()) job.last_call_start = now;
  job.finished_at = now;

  Job* placed = owned.get();
  s.jobs.emplace(job_id, std::move(owned));
  s.member_count += placed->members.size();
  s.ChargeJob(*placed);
  for (auto& [id, member] : placed->members) {
    if (!member.done && !placed->finished()) s.IndexLease(*placed, member);
  }
  s.ReindexJob(*placed);
  return absl::OkStatus();
}

absl::Status StateMachine::Restore(const state::ServerState& snapshot, absl::Time now) {
  Impl& s = *impl_;
  if (!s.jobs.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "Restore needs an empty state machine; this one holds %d jobs", s.jobs.size()));
  }
  absl::Status status;
  if (snapshot.format_version() == 0 && snapshot.jobs_size() == 0) {
    return absl::OkStatus();  // nothing was ever saved
  }
  if (snapshot.format_version() != kFormatVersion) {
    status =
        absl::DataLossError(absl::StrCat("snapshot format_version is ", snapshot.format_version(),
                                         "; this server reads ", kFormatVersion));
  }
  for (int i = 0; status.ok() && i < snapshot.jobs_size(); ++i) {
    status = s.RestoreJob(snapshot.jobs(i), now);
  }
  if (status.ok()) {
    absl::Status invariants = CheckInvariants(now);
    if (!invariants.ok()) {
      status = absl::DataLossError(
          absl::StrCat("restored state breaks an invariant: ", invariants.message()));
    }
  }
  if (!status.ok()) {
    Limits limits = s.limits;
    impl_ = std::make_unique<Impl>(std::move(limits));
    return status;
  }
  // A GATHERING job restored with its round complete (e.g. max reached)
  // closes now rather than at the next event.
  s.dirty = false;
  for (auto& [id, job] : s.jobs) s.EvaluateGathering(*job, now);
  return absl::OkStatus();
}

}  // namespace muster::rdzv
