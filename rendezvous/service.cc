// RendezvousService: the unary RPCs that are one StateMachine call each.
// Each handler checks the job secret (StateMachine::Authorize; Join hands
// the secret to Join itself), makes the call under mu_, and replies once the
// effect is durable (RunUnary in service_reactors.h).
#include "rendezvous/service.h"

#include "rendezvous/service_reactors.h"

namespace muster::rdzv {

grpc::ServerUnaryReactor* RendezvousService::Join(
    grpc::CallbackServerContext* context, const pb::JoinRequest* request,
    pb::JoinResponse* response) {
  return RunUnary(context, Rpc::kJoin, true,
                  [&](const std::string& secret) -> absl::Status {
                    absl::StatusOr<pb::JoinResponse> joined =
                        machine_.Join(*request, secret, clock_->Now());
                    if (!joined.ok()) return joined.status();
                    *response = *std::move(joined);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::KeepAlive(
    grpc::CallbackServerContext* context, const pb::KeepAliveRequest* request,
    pb::KeepAliveResponse* response) {
  // A renewal only moves a deadline later, so the timer need not wake.
  return RunUnary(context, Rpc::kKeepAlive, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::KeepAliveResponse> renewed =
                        machine_.KeepAlive(*request, clock_->Now());
                    if (!renewed.ok()) return renewed.status();
                    *response = *std::move(renewed);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::Leave(
    grpc::CallbackServerContext* context, const pb::LeaveRequest* request,
    pb::LeaveResponse* /*response*/) {
  return RunUnary(context, Rpc::kLeave, true,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    return machine_.Leave(*request, clock_->Now());
                  });
}

grpc::ServerUnaryReactor* RendezvousService::ReportFailure(
    grpc::CallbackServerContext* context,
    const pb::ReportFailureRequest* request,
    pb::ReportFailureResponse* response) {
  return RunUnary(context, Rpc::kReportFailure, true,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::JobState> state =
                        machine_.ReportFailure(*request, clock_->Now());
                    if (!state.ok()) return state.status();
                    *response->mutable_state() = *std::move(state);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::ReportDone(
    grpc::CallbackServerContext* context, const pb::ReportDoneRequest* request,
    pb::ReportDoneResponse* response) {
  return RunUnary(context, Rpc::kReportDone, true,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::JobState> state =
                        machine_.ReportDone(*request, clock_->Now());
                    if (!state.ok()) return state.status();
                    *response->mutable_state() = *std::move(state);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::Set(
    grpc::CallbackServerContext* context, const pb::SetRequest* request,
    pb::SetResponse* /*response*/) {
  return RunUnary(context, Rpc::kSet, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    return machine_.Set(*request);
                  });
}

grpc::ServerUnaryReactor* RendezvousService::Add(
    grpc::CallbackServerContext* context, const pb::AddRequest* request,
    pb::AddResponse* response) {
  return RunUnary(context, Rpc::kAdd, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::AddResponse> added =
                        machine_.Add(*request);
                    if (!added.ok()) return added.status();
                    *response = *std::move(added);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::CompareAndSet(
    grpc::CallbackServerContext* context,
    const pb::CompareAndSetRequest* request,
    pb::CompareAndSetResponse* response) {
  return RunUnary(context, Rpc::kCompareAndSet, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::CompareAndSetResponse> swapped =
                        machine_.CompareAndSet(*request);
                    if (!swapped.ok()) return swapped.status();
                    *response = *std::move(swapped);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::Delete(
    grpc::CallbackServerContext* context, const pb::DeleteRequest* request,
    pb::DeleteResponse* response) {
  return RunUnary(context, Rpc::kDelete, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::DeleteResponse> deleted =
                        machine_.Delete(*request);
                    if (!deleted.ok()) return deleted.status();
                    *response = *std::move(deleted);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::MultiGet(
    grpc::CallbackServerContext* context, const pb::MultiGetRequest* request,
    pb::MultiGetResponse* response) {
  return RunUnary(context, Rpc::kMultiGet, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::MultiGetResponse> values =
                        machine_.MultiGet(*request);
                    if (!values.ok()) return values.status();
                    *response = *std::move(values);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::ListJobs(
    grpc::CallbackServerContext* context, const pb::ListJobsRequest* /*request*/,
    pb::ListJobsResponse* response) {
  return RunUnary(context, Rpc::kListJobs, false,
                  [&](const std::string& /*secret*/) -> absl::Status {
                    *response = machine_.ListJobs();
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::DescribeJob(
    grpc::CallbackServerContext* context,
    const pb::DescribeJobRequest* request,
    pb::DescribeJobResponse* response) {
  return RunUnary(context, Rpc::kDescribeJob, false,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::JobState> state =
                        machine_.Describe(request->job_id(), clock_->Now());
                    if (!state.ok()) return state.status();
                    *response->mutable_state() = *std::move(state);
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* RendezvousService::CloseJob(
    grpc::CallbackServerContext* context, const pb::CloseJobRequest* request,
    pb::CloseJobResponse* response) {
  return RunUnary(context, Rpc::kCloseJob, true,
                  [&](const std::string& secret) -> absl::Status {
                    absl::Status allowed =
                        machine_.Authorize(request->job_id(), secret);
                    if (!allowed.ok()) return allowed;
                    absl::StatusOr<pb::JobState> state =
                        machine_.Close(*request, clock_->Now());
                    if (!state.ok()) return state.status();
                    *response->mutable_state() = *std::move(state);
                    return absl::OkStatus();
                  });
}

}  // namespace muster::rdzv
