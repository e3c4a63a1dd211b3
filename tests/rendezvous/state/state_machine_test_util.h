// A harness for StateMachine tests: a fake `now`, request builders, and an
// invariant check after every step.
#pragma once

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rendezvous/state/state_machine.h"

namespace muster::rdzv::testing {

inline absl::Status StatusOf(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Requires `expr` to fail with `expected_code`; shows the status otherwise.
#define REQUIRE_CODE(expr, expected_code)                           \
  do {                                                              \
    absl::Status status_ = ::muster::rdzv::testing::StatusOf(expr); \
    INFO(status_.ToString());                                       \
    REQUIRE(status_.code() == (expected_code));                     \
  } while (false)

#define REQUIRE_OK(expr) REQUIRE_CODE(expr, absl::StatusCode::kOk)

inline pb::JobConfig Config(uint32_t min_nodes, uint32_t max_nodes, int64_t last_call_ms = 1000,
                            int32_t max_restarts = 3) {
  pb::JobConfig config;
  config.set_min_nodes(min_nodes);
  config.set_max_nodes(max_nodes);
  config.set_join_timeout_ms(60'000);
  config.set_last_call_timeout_ms(last_call_ms);
  config.set_lease_ttl_ms(10'000);
  config.set_max_restarts(max_restarts);
  return config;
}

struct JoinArgs {
  std::string member_id;
  std::string hostname = "host";
  uint32_t nproc = 1;
  int32_t requested_rank = -1;
  std::string secret;
};

class Harness {
 public:
  explicit Harness(Limits limits = Limits()) : machine(limits) {}

  StateMachine machine;
  absl::Time now = absl::UnixEpoch() + absl::Hours(1);

  pb::JoinRequest JoinRequest(const std::string& job, const pb::JobConfig& config,
                              const JoinArgs& args = JoinArgs()) const {
    pb::JoinRequest request;
    request.set_job_id(job);
    *request.mutable_config() = config;
    request.set_address("10.0.0.1");
    request.set_hostname(args.hostname);
    request.set_nproc(args.nproc);
    request.set_requested_rank(args.requested_rank);
    request.set_member_id(args.member_id);
    return request;
  }

  absl::StatusOr<pb::JoinResponse> TryJoin(const std::string& job, const pb::JobConfig& config,
                                           const JoinArgs& args = JoinArgs()) {
    auto response = machine.Join(JoinRequest(job, config, args), args.secret, now);
    Check();
    return response;
  }

  // Joins and requires success; returns the member id.
  std::string Join(const std::string& job, const pb::JobConfig& config,
                   const JoinArgs& args = JoinArgs()) {
    auto response = TryJoin(job, config, args);
    REQUIRE_OK(response);
    return response->member_id();
  }

  std::string Rejoin(const std::string& job, const pb::JobConfig& config,
                     const std::string& member_id) {
    JoinArgs args;
    args.member_id = member_id;
    return Join(job, config, args);
  }

  absl::StatusOr<pb::KeepAliveResponse> KeepAlive(const std::string& job,
                                                  const std::string& member) {
    pb::KeepAliveRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    auto response = machine.KeepAlive(request, now);
    Check();
    return response;
  }

  absl::Status Leave(const std::string& job, const std::string& member) {
    pb::LeaveRequest request;
    request.set_job_id(job);
    request.set_member_id(member);
    absl::Status status = machine.Leave(request, now);
    Check();
    return status;
  }

  absl::StatusOr<pb::JobState> ReportFailure(const std::string& job, uint64_t round,
                                             const std::string& member, int exit_code = 1,
                                             bool permanent = false) {
    pb::ReportFailureRequest request;
    request.set_job_id(job);
    request.set_round(round);
    request.set_member_id(member);
    request.set_exit_code(exit_code);
    request.set_message("worker crashed");
    request.set_permanent(permanent);
    auto response = machine.ReportFailure(request, now);
    Check();
    return response;
  }

  absl::StatusOr<pb::JobState> ReportDone(const std::string& job, uint64_t round,
                                          const std::string& member) {
    pb::ReportDoneRequest request;
    request.set_job_id(job);
    request.set_round(round);
    request.set_member_id(member);
    auto response = machine.ReportDone(request, now);
    Check();
    return response;
  }

  absl::Status Set(const std::string& job, uint64_t round, const std::string& key,
                   const std::string& value) {
    pb::SetRequest request;
    request.set_job_id(job);
    request.set_round(round);
    request.set_key(key);
    request.set_value(value);
    auto status = machine.Set(request);
    Check();
    return status;
  }

  // Moves time forward and applies the deadlines.
  void Advance(absl::Duration by) {
    now += by;
    machine.Tick(now);
    Check();
  }

  pb::JobState State(const std::string& job) const {
    auto state = machine.State(job);
    REQUIRE_OK(state);
    return *state;
  }

  std::vector<std::string> RankOrder(const std::string& job) const {
    std::vector<std::string> ids;
    const pb::JobState state = State(job);
    for (const auto& member : state.members()) {
      ids.push_back(member.member_id());
    }
    return ids;
  }

  void Check() const {
    absl::Status status = machine.CheckInvariants(now);
    INFO(status.ToString());
    REQUIRE(status.ok());
  }
};

}  // namespace muster::rdzv::testing
