// Membership: Join, KeepAlive, Leave, ReportFailure, ReportDone, Close, and
// the time and change-tracking entry points.
//
// Every call that takes `now` first applies the deadlines at or before `now`
// (Tick), so it acts on the state as of `now`: a member whose lease lapsed
// is gone, and a round whose last call passed has closed, even if the
// service's timer has not fired yet.
#include "rendezvous/state/state_machine.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

#define MUSTER_RETURN_IF_ERROR(expr)                                  \
  do {                                                                \
    if (absl::Status status_ = (expr); !status_.ok()) return status_; \
  } while (false)

namespace {

absl::Status UnknownMember(const std::string& job_id, const std::string& member_id) {
  return absl::NotFoundError(
      absl::StrFormat("member %s is not in job %s; its lease may have expired; join without "
                      "a member_id",
                      member_id, job_id));
}

absl::Status UnknownJob(const std::string& job_id) {
  return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
}

absl::Status ValidateJoin(const pb::JoinRequest& request, const Limits& limits) {
  MUSTER_RETURN_IF_ERROR(ValidateId("job_id", request.job_id(), limits));
  if (!request.member_id().empty()) {
    MUSTER_RETURN_IF_ERROR(ValidateId("member_id", request.member_id(), limits));
  }
  MUSTER_RETURN_IF_ERROR(ValidateJobConfig(request.config()));
  if (request.nproc() < 1) {
    return absl::InvalidArgumentError("nproc is 0; a node runs >= 1 worker");
  }
  if (request.address().empty()) {
    return absl::InvalidArgumentError("address is empty");
  }
  // Addresses and hostnames are echoed to every member: keep them id-sized.
  if (request.address().size() > limits.max_id_bytes ||
      request.hostname().size() > limits.max_id_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("address or hostname is longer than %d bytes", limits.max_id_bytes));
  }
  if (const uint64_t multiple = request.config().world_size_multiple(); multiple > 1) {
    // nodes * nproc is a multiple of it exactly when nodes is a multiple
    // of `step`; the smallest such count from min_nodes up must fit max.
    const uint64_t step = multiple / std::gcd(multiple, uint64_t{request.nproc()});
    const uint64_t min_nodes = request.config().min_nodes();
    if ((min_nodes + step - 1) / step * step > request.config().max_nodes()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "config.world_size_multiple is %d, but no node count from min_nodes %d to max_nodes %d "
          "at nproc %d per node makes a world that is a multiple of it",
          multiple, min_nodes, request.config().max_nodes(), request.nproc()));
    }
  }
  if (request.requested_rank() < -1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "requested_rank is %d; use -1 to let the server choose", request.requested_rank()));
  }
  if (request.requested_rank() >= 0 &&
      static_cast<uint32_t>(request.requested_rank()) >= request.config().max_nodes()) {
    return absl::InvalidArgumentError(absl::StrFormat("requested_rank %d is not below max_nodes %d",
                                                      request.requested_rank(),
                                                      request.config().max_nodes()));
  }
  return absl::OkStatus();
}

// The member a join would leave behind, for sizing it before it exists.
MemberRecord NewMember(const pb::JoinRequest& request, const Job& job, const Limits& limits) {
  MemberRecord member;
  member.id = request.member_id().empty()
                  ? MakeMemberId(request.hostname(), job.next_member_number, limits)
                  : request.member_id();
  member.address = request.address();
  member.hostname = request.hostname();
  return member;
}

}  // namespace

StateMachine::StateMachine(Limits limits) : impl_(std::make_unique<Impl>(std::move(limits))) {}

StateMachine::~StateMachine() = default;
StateMachine::StateMachine(StateMachine&&) noexcept = default;
StateMachine& StateMachine::operator=(StateMachine&&) noexcept = default;

absl::StatusOr<pb::JoinResponse> StateMachine::Join(const pb::JoinRequest& request,
                                                    const std::string& secret, absl::Time now) {
  Impl& s = *impl_;
  MUSTER_RETURN_IF_ERROR(ValidateJoin(request, s.limits));
  s.TickUntil(now);
  const std::string& job_id = request.job_id();
  const int32_t requested_rank = request.requested_rank();
  Job* job = s.FindJob(job_id);
  if (job == nullptr) {
    if (!request.member_id().empty()) {
      return UnknownMember(job_id, request.member_id());
    }
    if (s.jobs.size() >= s.limits.max_jobs) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job %s cannot be created: the server holds %s; %s", job_id,
          Counted(s.jobs.size(), "job"), DescribeLimit(s.limits.max_jobs, "--max-jobs")));
    }
    if (s.limits.max_members_per_job == 0) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("job %s cannot be created: no member may join it; %s", job_id,
                          DescribeLimit(0, "--max-members-per-job")));
    }
    MUSTER_RETURN_IF_ERROR(CheckJoinTimeout(request.config(), s.limits));
    auto created = std::make_unique<Job>();
    created->id = job_id;
    created->config = request.config();
    if (!secret.empty()) created->secret_digest = Sha256(secret);
    created->gather_start = now;
    MUSTER_RETURN_IF_ERROR(s.CheckGrowth(
        nullptr, RecordBytes(*created) + MemberBytes(NewMember(request, *created, s.limits))));
    job = created.get();
    s.jobs.emplace(job_id, std::move(created));
    s.ChargeJob(*job);
    s.MarkDurableChanged(*job);
  } else {
    if (!job->secret_digest.empty() && !DigestsEqual(Sha256(secret), job->secret_digest)) {
      return absl::PermissionDeniedError(absl::StrFormat("wrong secret for job %s", job_id));
    }
    if (job->finished()) return JobClosedError(*job);
    MUSTER_RETURN_IF_ERROR(CheckSameConfig(job_id, job->config, request.config()));
  }

  std::string member_id = request.member_id();
  if (member_id.empty()) {
    if (job->members.size() >= s.limits.max_members_per_job) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("job %s has %s; %s", job_id, Counted(job->members.size(), "member"),
                          DescribeLimit(s.limits.max_members_per_job, "--max-members-per-job")));
    }
  } else if (!job->members.contains(member_id)) {
    return UnknownMember(job_id, member_id);
  }
  {
    // Addresses and hostnames count against the job's bytes: only growth
    // is checked, so a member re-joining as it was always may.
    auto existing = job->members.find(member_id);
    const size_t old_bytes = existing == job->members.end() ? 0 : MemberBytes(existing->second);
    const size_t new_bytes = MemberBytes(NewMember(request, *job, s.limits));
    if (new_bytes > old_bytes) {
      MUSTER_RETURN_IF_ERROR(s.CheckGrowth(job, new_bytes - old_bytes));
    }
  }
  if (requested_rank >= 0) {
    auto holder = job->requested_ranks.find(requested_rank);
    if (holder != job->requested_ranks.end() && holder->second != member_id) {
      return absl::FailedPreconditionError(
          absl::StrFormat("rank %d of job %s is already requested by member %s", requested_rank,
                          job_id, holder->second));
    }
  }

  // Validation is over: from here on the join succeeds.
  const bool fresh_member = member_id.empty();
  if (fresh_member) {
    do {
      member_id = MakeMemberId(request.hostname(), job->next_member_number++, s.limits);
    } while (job->members.contains(member_id));
    MemberRecord& created = job->members[member_id];
    created.id = member_id;
    ++s.member_count;
  }
  MemberRecord& member = job->members.at(member_id);
  const size_t old_member_bytes = fresh_member ? 0 : MemberBytes(member);
  if (member.requested_rank != requested_rank) {
    auto old = job->requested_ranks.find(member.requested_rank);
    if (old != job->requested_ranks.end() && old->second == member_id) {
      job->requested_ranks.erase(old);
    }
  }
  if (requested_rank >= 0) job->requested_ranks[requested_rank] = member_id;
  member.requested_rank = requested_rank;
  member.address = request.address();
  member.hostname = request.hostname();
  member.nproc = request.nproc();
  s.RechargeMember(*job, member, old_member_bytes);
  s.RenewLease(*job, member, now);
  s.MarkDurableChanged(*job);

  if (job->phase == pb::RUNNING) {
    if (member.group_rank >= 0) {
      // A member asks for a new round (e.g. to let waiting nodes in).
      s.EndRound(*job, pb::MEMBER_REJOINED, now);
      s.EnqueuePending(*job, member);
    } else if (member.queue != MemberRecord::Queue::kWaiting) {
      s.EnqueueWaiting(*job, member);
      s.MarkViewChanged(*job);
    }
  } else if (member.queue != MemberRecord::Queue::kPending || member.carried_spare) {
    // The first node to wait starts the join timeout: a round nobody
    // waited for (every node left it, as a preempted job's do until its
    // requeue, spares aside) has no clock running.
    if (!s.JoinClockRuns(*job)) job->gather_start = now;
    member.carried_spare = false;
    if (member.queue != MemberRecord::Queue::kPending) s.EnqueuePending(*job, member);
    s.MarkViewChanged(*job);
  }
  s.EvaluateGathering(*job, now);

  pb::JoinResponse response;
  response.set_member_id(member_id);
  bool waits_for_next = member.queue == MemberRecord::Queue::kWaiting;
  response.set_round(job->round + (waits_for_next ? 1 : 0));
  response.set_lease_ttl_ms(job->config.lease_ttl_ms());
  *response.mutable_state() = s.BuildState(*job);
  return response;
}

absl::StatusOr<std::pair<Job*, MemberRecord*>> StateMachine::Impl::LiveMember(
    const std::string& job_id, const std::string& member_id, absl::Time now) {
  Impl& s = *this;
  MUSTER_RETURN_IF_ERROR(ValidateId("job_id", job_id, s.limits));
  MUSTER_RETURN_IF_ERROR(ValidateId("member_id", member_id, s.limits));
  s.TickUntil(now);
  Job* job = s.FindJob(job_id);
  if (job == nullptr) return UnknownJob(job_id);
  if (job->finished()) return JobClosedError(*job);
  auto it = job->members.find(member_id);
  if (it == job->members.end()) return UnknownMember(job_id, member_id);
  return std::make_pair(job, &it->second);
}

absl::StatusOr<pb::KeepAliveResponse> StateMachine::KeepAlive(const pb::KeepAliveRequest& request,
                                                              absl::Time now) {
  absl::StatusOr<std::pair<Job*, MemberRecord*>> found =
      impl_->LiveMember(request.job_id(), request.member_id(), now);
  if (!found.ok()) return found.status();
  auto [job, member] = *found;
  // Deliberately neither dirty nor changed: renewals are not durable and do
  // not change the watch view.
  impl_->RenewLease(*job, *member, now);
  pb::KeepAliveResponse response;
  response.set_lease_ttl_ms(job->config.lease_ttl_ms());
  response.set_version(job->version);
  return response;
}

absl::Status StateMachine::Leave(const pb::LeaveRequest& request, absl::Time now) {
  Impl& s = *impl_;
  absl::StatusOr<std::pair<Job*, MemberRecord*>> found =
      s.LiveMember(request.job_id(), request.member_id(), now);
  if (!found.ok()) return found.status();
  Job* job = found->first;
  MemberRecord& member = *found->second;
  if (member.group_rank >= 0) {
    if (member.done) {
      // A done member may exit; it stays on the round's roster so the round
      // can still succeed once the others are done.
      return absl::OkStatus();
    }
    s.EndRound(*job, pb::MEMBER_LEFT, now);
    s.RemoveMember(*job, request.member_id());
  } else {
    bool queued = member.queue != MemberRecord::Queue::kNone;
    s.RemoveMember(*job, request.member_id());
    if (queued) s.MarkViewChanged(*job);
  }
  s.EvaluateGathering(*job, now);
  return absl::OkStatus();
}

absl::StatusOr<pb::JobState> StateMachine::ReportFailure(const pb::ReportFailureRequest& request,
                                                         absl::Time now) {
  Impl& s = *impl_;
  s.TickUntil(now);
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  absl::StatusOr<MemberRecord*> member = s.RoundMember(**job, request.member_id());
  if (!member.ok()) return member.status();
  pb::Failure failure;
  failure.set_member_id(request.member_id());
  failure.set_round(request.round());
  failure.set_exit_code(request.exit_code());
  failure.set_message(Truncate(request.message(), kMaxMessageBytes));
  s.FailRound(**job, pb::MEMBER_FAILED, std::move(failure), now, request.permanent());
  // The reporter is not pending for the next round: everybody re-joins.
  s.EvaluateGathering(**job, now);
  return s.BuildState(**job);
}

absl::StatusOr<pb::JobState> StateMachine::ReportDone(const pb::ReportDoneRequest& request,
                                                      absl::Time now) {
  Impl& s = *impl_;
  s.TickUntil(now);
  absl::StatusOr<Job*> job_or = s.FenceRound(request.job_id(), request.round());
  if (!job_or.ok()) return job_or.status();
  Job& job = **job_or;
  absl::StatusOr<MemberRecord*> member = s.RoundMember(job, request.member_id());
  if (!member.ok()) return member.status();
  if (!(*member)->done) {
    (*member)->done = true;
    ++job.nodes_done;
    s.UnindexLease(job, **member);
    s.MarkViewChanged(job);
  }
  if (job.nodes_done == job.round_members.size()) {
    s.FinishJob(job, pb::SUCCEEDED, "", now);
  }
  return s.BuildState(job);
}

absl::StatusOr<pb::JobState> StateMachine::Close(const pb::CloseJobRequest& request,
                                                 absl::Time now) {
  Impl& s = *impl_;
  MUSTER_RETURN_IF_ERROR(ValidateId("job_id", request.job_id(), s.limits));
  s.TickUntil(now);
  Job* job = s.FindJob(request.job_id());
  if (job == nullptr) return UnknownJob(request.job_id());
  if (job->finished()) return JobClosedError(*job);
  std::string reason = request.reason().empty() ? "closed by administrator"
                                                : Truncate(request.reason(), kMaxMessageBytes);
  s.FinishJob(*job, pb::CLOSED, std::move(reason), now);
  return s.BuildState(*job);
}

absl::Status StateMachine::Authorize(const std::string& job_id, const std::string& secret) const {
  Job* job = impl_->FindJob(job_id);
  if (job == nullptr || job->secret_digest.empty()) return absl::OkStatus();
  if (DigestsEqual(Sha256(secret), job->secret_digest)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrFormat("wrong secret for job %s", job_id));
}

void StateMachine::Tick(absl::Time now) { impl_->TickUntil(now); }

absl::Time StateMachine::NextDeadline() const {
  const Impl& s = *impl_;
  absl::Time next = absl::InfiniteFuture();
  if (!s.lease_index.empty()) next = std::get<0>(*s.lease_index.begin());
  if (!s.job_deadlines.empty()) {
    next = std::min(next, s.job_deadlines.begin()->first);
  }
  return next;
}

std::vector<std::string> StateMachine::TakeChangedJobs() {
  std::vector<std::string> changed(impl_->changed_jobs.begin(), impl_->changed_jobs.end());
  impl_->changed_jobs.clear();
  return changed;
}

bool StateMachine::TakeDirty() {
  bool dirty = impl_->dirty;
  impl_->dirty = false;
  return dirty;
}

size_t StateMachine::job_count() const { return impl_->jobs.size(); }

size_t StateMachine::member_count() const { return impl_->member_count; }

}  // namespace muster::rdzv
