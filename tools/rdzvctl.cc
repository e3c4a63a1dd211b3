// rdzvctl: inspect and administer a rendezvous server.
//
//   rdzvctl [--endpoint host:port] [--token-file F] [--tls-ca F]
//           [--tls-cert F --tls-key F] [--job-secret-file F] [--timeout S]
//           list | describe JOB | close JOB [--reason TEXT] | health
//
// `health` calls the standard grpc.health.v1.Health/Check (the server
// registers gRPC's default health service; it takes no token).
//
// Exit codes: 0 success (health: the server reports SERVING); 1 the call
// failed (one line: status code name and message) or the server reports
// another health status; 2 bad usage or unusable options.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "rendezvous/client/client.h"

namespace muster::rdzv {
namespace {

constexpr int kExitCallFailed = 1;
constexpr int kExitUsage = 2;

int Fail(const absl::Status& status, int exit_code) {
  std::fprintf(stderr, "rdzvctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return exit_code;
}

// A call on one job that failed, with what the server's message leaves
// out: that no secret was given (it says "wrong secret" either way).
int FailOnJob(const absl::Status& status, bool secret_given) {
  if (status.code() == absl::StatusCode::kPermissionDenied && !secret_given) {
    return Fail(absl::Status(status.code(), absl::StrCat(status.message(),
                                                         " (none given: the job has a job "
                                                         "secret; pass --job-secret-file)")),
                kExitCallFailed);
  }
  return Fail(status, kExitCallFailed);
}

std::string PhaseName(pb::Phase phase) {
  std::string name = pb::Phase_Name(phase);
  return name.empty() ? absl::StrCat(static_cast<int>(phase)) : name;
}

std::string FormatAge(int64_t millis) {
  if (millis < 0) return "-";
  return absl::StrFormat("%.1fs", millis / 1000.0);
}

int List(Client& client) {
  absl::StatusOr<pb::ListJobsResponse> jobs = client.ListJobs();
  if (!jobs.ok()) return Fail(jobs.status(), kExitCallFailed);
  std::printf("%-24s %-10s %6s %6s %6s %8s %9s\n", "JOB", "PHASE", "ROUND", "NODES", "WORLD",
              "WAITING", "RESTARTS");
  for (const pb::JobSummary& job : jobs->jobs()) {
    std::printf("%-24s %-10s %6llu %6u %6u %8u %9s\n", job.job_id().c_str(),
                PhaseName(job.phase()).c_str(), static_cast<unsigned long long>(job.round()),
                job.nodes(), job.world_size(), job.nodes_waiting(),
                absl::StrCat(job.restart_count(), "/", job.max_restarts()).c_str());
  }
  if (jobs->jobs().empty()) std::printf("(no jobs)\n");
  if (jobs->hidden() > 0) {
    std::printf("(%u more job%s with a job secret not presented: --job-secret-file)\n",
                jobs->hidden(), jobs->hidden() == 1 ? "" : "s");
  }
  return 0;
}

void PrintState(const pb::JobState& state) {
  std::printf("job:        %s\n", state.job_id().c_str());
  std::printf("phase:      %s\n", PhaseName(state.phase()).c_str());
  std::printf("round:      %llu (version %llu)\n", static_cast<unsigned long long>(state.round()),
              static_cast<unsigned long long>(state.version()));
  // As `list` counts them: a gathering round has no members yet, so its
  // nodes are those joined so far (pending).
  const bool gathering = state.phase() == pb::GATHERING;
  std::printf("nodes:      %u%s of min %u, max %u; world size %u\n",
              gathering ? state.nodes_pending() : static_cast<uint32_t>(state.members_size()),
              gathering ? " joined" : "", state.config().min_nodes(), state.config().max_nodes(),
              state.world_size());
  if (state.config().world_size_multiple() > 1) {
    std::printf("worlds:     multiples of %u; %u waiting node(s) a new round would admit\n",
                state.config().world_size_multiple(), state.nodes_admittable());
  }
  std::printf("restarts:   %d/%d\n", state.restart_count(), state.config().max_restarts());
  if (state.last_end_reason() != pb::END_REASON_UNSPECIFIED) {
    std::printf("last end:   %s\n", pb::RoundEndReason_Name(state.last_end_reason()).c_str());
  }
  if (!state.status_message().empty()) {
    std::printf("status:     %s\n", state.status_message().c_str());
  }
  std::printf("\nmembers (%d):\n", state.members_size());
  std::printf("  %5s %7s %5s %-20s %-16s %-36s %9s\n", "RANK", "OFFSET", "NPROC", "ADDRESS",
              "HOSTNAME", "MEMBER", "LEASE AGE");
  for (const pb::Member& member : state.members()) {
    std::printf("  %5d %7u %5u %-20s %-16s %-36s %9s\n", member.group_rank(), member.rank_offset(),
                member.nproc(), member.address().c_str(), member.hostname().c_str(),
                member.member_id().c_str(), FormatAge(member.lease_age_ms()).c_str());
  }
  std::printf("\nwaiting (%u waiting, %u pending):\n", state.nodes_waiting(),
              state.nodes_pending());
  for (const pb::Member& member : state.waiting()) {
    std::printf("  %-36s %-20s %-16s nproc %u, lease age %s\n", member.member_id().c_str(),
                member.address().c_str(), member.hostname().c_str(), member.nproc(),
                FormatAge(member.lease_age_ms()).c_str());
  }
  if (state.failures_size() > 0) {
    std::printf("\nfailures (%d):\n", state.failures_size());
    for (const pb::Failure& failure : state.failures()) {
      std::printf("  round %llu member %s exit %d%s%s\n",
                  static_cast<unsigned long long>(failure.round()), failure.member_id().c_str(),
                  failure.exit_code(), failure.message().empty() ? "" : ": ",
                  failure.message().c_str());
    }
  }
}

int Describe(Client& client, const std::string& job_id) {
  pb::DescribeJobRequest request;
  request.set_job_id(job_id);
  absl::StatusOr<pb::DescribeJobResponse> response = client.DescribeJob(request);
  if (!response.ok())
    return FailOnJob(response.status(), !client.options().job_secret_file.empty());
  PrintState(response->state());
  return 0;
}

int Close(Client& client, const std::string& job_id, const std::string& reason) {
  pb::CloseJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  absl::StatusOr<pb::CloseJobResponse> response = client.CloseJob(request);
  // A finished job cannot be closed, and exits 1 so that a script learns
  // the job ended some other way; the server's message names how.
  if (response.status().code() == absl::StatusCode::kFailedPrecondition) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
                    response.status().message(), ": it has already finished; nothing to close")),
                kExitCallFailed);
  }
  if (!response.ok())
    return FailOnJob(response.status(), !client.options().job_secret_file.empty());
  std::printf("job %s: %s\n", job_id.c_str(), PhaseName(response->state().phase()).c_str());
  return 0;
}

int Health(Client& client) {
  const absl::Time start = absl::Now();
  absl::StatusOr<ServingStatus> status = client.CheckHealth();
  if (!status.ok()) return Fail(status.status(), kExitCallFailed);
  const double elapsed_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (*status != ServingStatus::kServing) {
    std::fprintf(stderr, "rdzvctl: %s reports %s (grpc.health.v1.Health), %.1f ms\n",
                 client.options().endpoint.c_str(), ServingStatusName(*status).c_str(), elapsed_ms);
    return kExitCallFailed;
  }
  std::printf("ok: %s SERVING (grpc.health.v1.Health), %.1f ms\n",
              client.options().endpoint.c_str(), elapsed_ms);
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app{"Inspect and administer a muster rendezvous server"};
  app.require_subcommand(1);
  ClientOptions options;
  double timeout_seconds = 5;
  app.add_option("--endpoint", options.endpoint, "server host[:port]")->capture_default_str();
  app.add_option("--token-file", options.token_file, "bearer token file");
  app.add_option("--tls-ca", options.tls_ca_file, "CA to verify the server");
  app.add_option("--tls-cert", options.tls_cert_file, "client cert (mTLS)");
  app.add_option("--tls-key", options.tls_key_file, "client key (mTLS)");
  // The client reads it as launch does: an empty file is refused, not
  // taken for no secret.
  app.add_option("--job-secret-file", options.job_secret_file, "the job's secret");
  // Not CLI::PositiveNumber: it lets NaN through (a call without a
  // deadline) and words a refusal as "0 not in range 0 to <310 digits>".
  app.add_option("--timeout", timeout_seconds, "seconds per call")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double value = 0;
            if (absl::SimpleAtod(text, &value) && std::isfinite(value) && value > 0) return "";
            return absl::StrCat("must be a number of seconds > 0, not '", text, "'");
          },
          "> 0"));

  std::string job_id, reason;
  CLI::App* list = app.add_subcommand("list", "list jobs");
  CLI::App* describe = app.add_subcommand("describe", "show one job");
  describe->add_option("JOB", job_id, "job id")->required();
  CLI::App* close = app.add_subcommand("close", "close a job");
  close->add_option("JOB", job_id, "job id")->required();
  close->add_option("--reason", reason, "why (shown to the job's agents)");
  CLI::App* health =
      app.add_subcommand("health", "check the server reports SERVING (grpc.health.v1.Health)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    int code = app.exit(error);
    return code == 0 ? 0 : kExitUsage;
  }

  options.rpc_timeout = absl::Seconds(timeout_seconds);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) return Fail(client.status(), kExitUsage);

  if (*list) return List(**client);
  if (*describe) return Describe(**client, job_id);
  // `--reason ""` reads as no reason, not as the server's own default.
  if (*close) return Close(**client, job_id, reason.empty() ? "closed by rdzvctl" : reason);
  if (*health) return Health(**client);
  return kExitUsage;
}

}  // namespace
}  // namespace muster::rdzv

int main(int argc, char** argv) { return muster::rdzv::Main(argc, argv); }
