// RendezvousService: the unary RPCs that are one StateMachine call each.
// Each handler checks the job secret (StateMachine::Authorize; Join hands
// the secret to Join itself), makes the call under mu_, and replies once the
// effect is durable (RunUnary in service_reactors.h). Also here: the quota
// of jobs per caller identity, counted in the service because the state
// machine knows jobs, not who created them.
#include "rendezvous/server/service.h"

#include "absl/strings/str_cat.h"
#include "rendezvous/server/service_reactors.h"

namespace muster::rdzv {

grpc::ServerUnaryReactor* RendezvousService::Join(grpc::CallbackServerContext* context,
                                                  const pb::JoinRequest* request,
                                                  pb::JoinResponse* response) {
  const std::string identity = CallerIdentity(*context);
  return RunUnary(context, Rpc::kJoin, true, [&](const std::string& secret) -> absl::Status {
    const bool creates = !machine_.Version(request->job_id()).ok();
    if (creates) {
      absl::Status quota = CheckJobQuota(identity);
      if (!quota.ok()) return quota;
    }
    absl::StatusOr<pb::JoinResponse> joined = machine_.Join(*request, secret, clock_->Now());
    if (!joined.ok()) return joined.status();
    CountJob(request->job_id(), identity, creates);
    *response = *std::move(joined);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::KeepAlive(grpc::CallbackServerContext* context,
                                                       const pb::KeepAliveRequest* request,
                                                       pb::KeepAliveResponse* response) {
  const std::string identity = CallerIdentity(*context);
  // A renewal only moves a deadline later, so the timer need not wake.
  return RunUnary(context, Rpc::kKeepAlive, false, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::KeepAliveResponse> renewed = machine_.KeepAlive(*request, clock_->Now());
    if (!renewed.ok()) return renewed.status();
    // A job restored from the state file is counted for
    // the identity that renews in it (agents do so every
    // lease_ttl/3).
    CountJob(request->job_id(), identity, false);
    *response = *std::move(renewed);
    return absl::OkStatus();
  });
}

absl::Status RendezvousService::CheckJobQuota(const std::string& identity) {
  auto jobs = jobs_of_identity_.find(identity);
  if (jobs == jobs_of_identity_.end()) return absl::OkStatus();
  if (jobs->second.size() >= options_.max_jobs_per_identity) {
    // Only now is it worth dropping the jobs the state machine forgot.
    for (auto job = jobs->second.begin(); job != jobs->second.end();) {
      auto owner = identity_of_job_.find(*job);
      bool counted = owner != identity_of_job_.end() && owner->second == identity;
      if (counted && machine_.Version(*job).ok()) {
        ++job;
        continue;
      }
      if (counted) identity_of_job_.erase(owner);
      jobs->second.erase(job++);
    }
  }
  if (jobs->second.size() < options_.max_jobs_per_identity) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("callers ", identity.empty() ? "without a job secret" : "with this job secret",
                   " already have ", Counted(jobs->second.size(), "job"), "; per identity, ",
                   DescribeLimit(options_.max_jobs_per_identity, "--max-jobs-per-identity"),
                   "; a job counts until the server drops it, --closed-retention after it "
                   "finishes or is closed"));
}

void RendezvousService::CountJob(const std::string& job_id, const std::string& identity,
                                 bool created) {
  auto [owner, inserted] = identity_of_job_.try_emplace(job_id, identity);
  if (!inserted) {
    if (!created || owner->second == identity) return;
    // The id of a dropped job, created again by someone else.
    auto previous = jobs_of_identity_.find(owner->second);
    if (previous != jobs_of_identity_.end()) previous->second.erase(job_id);
    owner->second = identity;
  }
  jobs_of_identity_[identity].insert(job_id);
  if (identity_of_job_.size() > 2 * machine_.job_count() + 64) ForgetDroppedJobs();
}

void RendezvousService::ForgetDroppedJobs() {
  for (auto job = identity_of_job_.begin(); job != identity_of_job_.end();) {
    if (machine_.Version(job->first).ok()) {
      ++job;
      continue;
    }
    auto jobs = jobs_of_identity_.find(job->second);
    if (jobs != jobs_of_identity_.end()) {
      jobs->second.erase(job->first);
      if (jobs->second.empty()) jobs_of_identity_.erase(jobs);
    }
    identity_of_job_.erase(job++);
  }
}

grpc::ServerUnaryReactor* RendezvousService::Leave(grpc::CallbackServerContext* context,
                                                   const pb::LeaveRequest* request,
                                                   pb::LeaveResponse* /*response*/) {
  return RunUnary(context, Rpc::kLeave, true, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    return machine_.Leave(*request, clock_->Now());
  });
}

grpc::ServerUnaryReactor* RendezvousService::ReportFailure(grpc::CallbackServerContext* context,
                                                           const pb::ReportFailureRequest* request,
                                                           pb::ReportFailureResponse* response) {
  return RunUnary(
      context, Rpc::kReportFailure, true, [&](const std::string& secret) -> absl::Status {
        absl::Status allowed = machine_.Authorize(request->job_id(), secret);
        if (!allowed.ok()) return allowed;
        absl::StatusOr<pb::JobState> state = machine_.ReportFailure(*request, clock_->Now());
        if (!state.ok()) return state.status();
        *response->mutable_state() = *std::move(state);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* RendezvousService::ReportDone(grpc::CallbackServerContext* context,
                                                        const pb::ReportDoneRequest* request,
                                                        pb::ReportDoneResponse* response) {
  return RunUnary(context, Rpc::kReportDone, true, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::JobState> state = machine_.ReportDone(*request, clock_->Now());
    if (!state.ok()) return state.status();
    *response->mutable_state() = *std::move(state);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::Set(grpc::CallbackServerContext* context,
                                                 const pb::SetRequest* request,
                                                 pb::SetResponse* /*response*/) {
  return RunUnary(context, Rpc::kSet, false, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    return machine_.Set(*request);
  });
}

grpc::ServerUnaryReactor* RendezvousService::Add(grpc::CallbackServerContext* context,
                                                 const pb::AddRequest* request,
                                                 pb::AddResponse* response) {
  return RunUnary(context, Rpc::kAdd, false, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::AddResponse> added = machine_.Add(*request);
    if (!added.ok()) return added.status();
    *response = *std::move(added);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::CompareAndSet(grpc::CallbackServerContext* context,
                                                           const pb::CompareAndSetRequest* request,
                                                           pb::CompareAndSetResponse* response) {
  return RunUnary(
      context, Rpc::kCompareAndSet, false, [&](const std::string& secret) -> absl::Status {
        absl::Status allowed = machine_.Authorize(request->job_id(), secret);
        if (!allowed.ok()) return allowed;
        absl::StatusOr<pb::CompareAndSetResponse> swapped = machine_.CompareAndSet(*request);
        if (!swapped.ok()) return swapped.status();
        *response = *std::move(swapped);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* RendezvousService::Delete(grpc::CallbackServerContext* context,
                                                    const pb::DeleteRequest* request,
                                                    pb::DeleteResponse* response) {
  return RunUnary(context, Rpc::kDelete, false, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::DeleteResponse> deleted = machine_.Delete(*request);
    if (!deleted.ok()) return deleted.status();
    *response = *std::move(deleted);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::MultiGet(grpc::CallbackServerContext* context,
                                                      const pb::MultiGetRequest* request,
                                                      pb::MultiGetResponse* response) {
  return RunUnary(context, Rpc::kMultiGet, false, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::MultiGetResponse> values = machine_.MultiGet(*request);
    if (!values.ok()) return values.status();
    *response = *std::move(values);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::ListJobs(grpc::CallbackServerContext* context,
                                                      const pb::ListJobsRequest* /*request*/,
                                                      pb::ListJobsResponse* response) {
  return RunUnary(context, Rpc::kListJobs, false, [&](const std::string& secret) -> absl::Status {
    // A job secret keeps a job to those who hold it, its name and shape
    // included: the bearer token is one for every tenant of the server.
    pb::ListJobsResponse all = machine_.ListJobs();
    for (pb::JobSummary& job : *all.mutable_jobs()) {
      if (machine_.Authorize(job.job_id(), secret).ok()) {
        *response->add_jobs() = std::move(job);
      } else {
        response->set_hidden(response->hidden() + 1);
      }
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* RendezvousService::DescribeJob(grpc::CallbackServerContext* context,
                                                         const pb::DescribeJobRequest* request,
                                                         pb::DescribeJobResponse* response) {
  return RunUnary(
      context, Rpc::kDescribeJob, false, [&](const std::string& secret) -> absl::Status {
        absl::Status allowed = machine_.Authorize(request->job_id(), secret);
        if (!allowed.ok()) return allowed;
        absl::StatusOr<pb::JobState> state = machine_.Describe(request->job_id(), clock_->Now());
        if (!state.ok()) return state.status();
        *response->mutable_state() = *std::move(state);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* RendezvousService::CloseJob(grpc::CallbackServerContext* context,
                                                      const pb::CloseJobRequest* request,
                                                      pb::CloseJobResponse* response) {
  return RunUnary(context, Rpc::kCloseJob, true, [&](const std::string& secret) -> absl::Status {
    absl::Status allowed = machine_.Authorize(request->job_id(), secret);
    if (!allowed.ok()) return allowed;
    absl::StatusOr<pb::JobState> state = machine_.Close(*request, clock_->Now());
    if (!state.ok()) return state.status();
    *response->mutable_state() = *std::move(state);
    return absl::OkStatus();
  });
}

}  // namespace muster::rdzv
