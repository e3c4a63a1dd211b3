// The worker's environment contract (parallel/bootstrap.h) and a world of
// one. The multi-process path is in collective_launch_test.cc.
#include "parallel/bootstrap.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "absl/strings/match.h"

namespace muster::parallel {
namespace {

using Env = std::map<std::string, std::string>;

Env LaunchEnv() {
  return {{"RANK", "2"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_RANK", "0"},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MUSTER_RDZV_ENDPOINT", "127.0.0.1:29400"},
          {"MUSTER_JOB", "job7"},
          {"MUSTER_ROUND", "3"}};
}

void CheckRejected(const Env& env, const std::string& variable) {
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(env);
  INFO(world.status().ToString());
  CHECK(world.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(world.status().message(), variable));
}

TEST_CASE("launch's environment gives the world and the round") {
  Env env = LaunchEnv();
  env["MUSTER_TOKEN_FILE"] = "/run/token";
  env["MUSTER_JOB_SECRET_FILE"] = "/run/secret";
  env["MUSTER_COMM_TIMEOUT_S"] = "2.5";
  env["MUSTER_LOCAL_ADDR"] = "10.0.0.5";
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(env);
  REQUIRE(world.ok());
  CHECK(world->rank == 2);
  CHECK(world->world_size == 4);
  CHECK(world->rdzv_endpoint == "127.0.0.1:29400");
  CHECK(world->job_id == "job7");
  CHECK(world->round == 3);
  CHECK(world->token_file == "/run/token");
  CHECK(world->job_secret_file == "/run/secret");
  CHECK(world->tls_ca.empty());
  CHECK(world->local_addr == "10.0.0.5");
  CHECK(world->comm_timeout == absl::Milliseconds(2500));
}

TEST_CASE("no WORLD_SIZE, or WORLD_SIZE=1, is a world of one that needs nothing else") {
  for (const Env& env :
       {Env{}, Env{{"WORLD_SIZE", "1"}}, Env{{"WORLD_SIZE", "1"}, {"RANK", "0"}}}) {
    absl::StatusOr<WorldInfo> world = WorldFromEnvironment(env);
    REQUIRE(world.ok());
    CHECK(world->world_size == 1);
    CHECK(world->rank == 0);
  }
  // A rank that a world of one cannot have is a launcher's mistake, not a
  // run to start as rank 0.
  CheckRejected(Env{{"WORLD_SIZE", "1"}, {"RANK", "3"}}, "RANK=3 is outside [0, WORLD_SIZE=1)");
  CheckRejected(Env{{"RANK", "x"}}, "RANK");
}

TEST_CASE("malformed or missing variables are named") {
  auto with = [](const std::string& key, const std::string& value) {
    Env env = LaunchEnv();
    env[key] = value;
    return env;
  };
  auto without = [](const std::string& key) {
    Env env = LaunchEnv();
    env.erase(key);
    return env;
  };
  CheckRejected(with("WORLD_SIZE", "four"), "WORLD_SIZE");
  CheckRejected(with("WORLD_SIZE", "0"), "WORLD_SIZE");
  CheckRejected(with("RANK", "4"), "RANK");
  CheckRejected(with("RANK", "-1"), "RANK");
  CheckRejected(without("RANK"), "RANK");
  CheckRejected(with("LOCAL_RANK", "x"), "LOCAL_RANK");
  CheckRejected(with("MUSTER_ROUND", "3a"), "MUSTER_ROUND");
  CheckRejected(without("MUSTER_ROUND"), "MUSTER_ROUND");
  CheckRejected(without("MUSTER_JOB"), "MUSTER_JOB");
  CheckRejected(without("MUSTER_RDZV_ENDPOINT"), "MUSTER_RDZV_ENDPOINT");
  CheckRejected(with("MUSTER_COMM_TIMEOUT_S", "0"), "MUSTER_COMM_TIMEOUT_S");
  CheckRejected(with("MUSTER_COMM_TIMEOUT_S", "soon"), "MUSTER_COMM_TIMEOUT_S");
}

TEST_CASE("the local address is the one that routes toward the master") {
  CHECK(LocalAddressToward("127.0.0.1") == "127.0.0.1");
  CHECK(LocalAddressToward("") == "127.0.0.1");
  CHECK(LocalAddressToward("no-such-host.invalid") == "127.0.0.1");
}

TEST_CASE("a world of one connects without a rendezvous service") {
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(Env{});
  REQUIRE(world.ok());
  absl::StatusOr<std::unique_ptr<Communicator>> comm = Communicator::Connect(*world);
  INFO(comm.status().ToString());
  REQUIRE(comm.ok());
  CHECK((*comm)->group().size() == 1);
  std::vector<float> data = {1, 2, 3};
  CHECK((*comm)->group().AllReduce(absl::MakeSpan(data), ReduceOp::kAvg)->Wait().ok());
  CHECK(data == std::vector<float>{1, 2, 3});
}

TEST_CASE("a world of one: no watchdog; the data group is the Gloo group under kGloo") {
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(Env{});
  REQUIRE(world.ok());
  absl::StatusOr<std::unique_ptr<Communicator>> comm = Communicator::Connect(*world);
  REQUIRE(comm.ok());
  CHECK((*comm)->watchdog() == nullptr);
  CHECK(&(*comm)->data_group() == &(*comm)->group());
  CHECK(&(*comm)->control_group() == &(*comm)->group());
}

TEST_CASE("the CUDA backends need a CUDA build, and say so") {
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(Env{});
  REQUIRE(world.ok());
  for (DataBackend backend : {DataBackend::kNccl, DataBackend::kStagedGloo}) {
    CommunicatorOptions options;
    options.data_backend = backend;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Communicator::Connect(*world, options);
#ifdef MUSTER_CUDA
    (void)comm;  // needs a GPU: tests/parallel/staged_group_cuda_test, scripts/gpu_run.sh
#else
    INFO(comm.status().ToString());
    CHECK(absl::IsFailedPrecondition(comm.status()));
    CHECK(absl::StrContains(comm.status().message(), "--config=cuda"));
#endif
  }
}

TEST_CASE("RoundStatus: running is OK; another round or phase names the round and why") {
  CHECK(RoundStatus(std::nullopt, "j", 3).ok());
  rdzv::pb::JobState state;
  state.set_round(3);
  state.set_phase(rdzv::pb::RUNNING);
  CHECK(RoundStatus(state, "j", 3).ok());

  state.set_round(4);
  state.set_phase(rdzv::pb::GATHERING);
  state.set_last_end_reason(rdzv::pb::MEMBER_FAILED);
  rdzv::pb::Failure* old = state.add_failures();
  old->set_round(2);
  old->set_member_id("m-old");
  old->set_exit_code(1);
  rdzv::pb::Failure* failure = state.add_failures();
  failure->set_round(3);
  failure->set_member_id("node1-2");
  failure->set_exit_code(137);
  failure->set_message("rank 3 exited with signal 9 (SIGKILL)");
  absl::Status ended = RoundStatus(state, "j", 3);
  CHECK(absl::IsAborted(ended));
  CHECK(ended.message() ==
        "rendezvous round 3 of job 'j' ended (MEMBER_FAILED: member node1-2 exited 137, rank 3 "
        "exited with signal 9 (SIGKILL)); the job is now at round 4, GATHERING");

  // A lapsed lease is a failure without an exit code.
  failure->set_exit_code(-1);
  failure->set_message("lease of node1-2 expired");
  state.set_last_end_reason(rdzv::pb::MEMBER_LOST);
  CHECK(RoundStatus(state, "j", 3).message() ==
        "rendezvous round 3 of job 'j' ended (MEMBER_LOST: lease of node1-2 expired); the job "
        "is now at round 4, GATHERING");

  // The same round, but the job closed by an administrator.
  rdzv::pb::JobState closed;
  closed.set_round(3);
  closed.set_phase(rdzv::pb::CLOSED);
  absl::Status status = RoundStatus(closed, "j", 3);
  CHECK(absl::IsAborted(status));
  CHECK_THAT(std::string(status.message()),
             Catch::Contains("round 3 of job 'j' ended: the job is CLOSED"));
}

TEST_CASE("a bad job secret file is reported before any connection") {
  Env env = LaunchEnv();
  env["MUSTER_JOB_SECRET_FILE"] = "/nonexistent/secret";
  absl::StatusOr<WorldInfo> world = WorldFromEnvironment(env);
  REQUIRE(world.ok());
  auto comm = Communicator::Connect(*world);
  CHECK(comm.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(comm.status().message(), "job secret file"));
  CHECK(absl::StrContains(comm.status().message(), "/nonexistent/secret"));
}

}  // namespace
}  // namespace muster::parallel
