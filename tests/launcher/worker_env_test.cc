#include "launcher/worker_env.h"

#include <catch2/catch.hpp>
#include <map>

namespace muster::launcher {
namespace {

std::map<std::string, std::string> AsMap(const std::vector<std::string>& entries) {
  std::map<std::string, std::string> env;
  for (const std::string& entry : entries) {
    size_t equals = entry.find('=');
    env[entry.substr(0, equals)] = entry.substr(equals + 1);
  }
  return env;
}

TEST_CASE("workers get torchrun's variables and ours") {
  RoundAssignment round;
  round.round = 4;
  round.group_rank = 1;
  round.group_world_size = 2;
  round.rank_offset = 2;
  round.local_world_size = 2;
  round.world_size = 4;
  round.master_addr = "10.0.0.1";
  round.master_port = 41000;
  round.restart_count = 1;
  round.max_restarts = 3;
  round.run_id = "job7";
  RendezvousAccess access{"rdzv:29400", "/run/token", "", "", "", ""};
  auto env = AsMap(WorkerEnvironment({{"PATH", "/bin"}, {"MUSTER_TLS_CA", "stale"}}, round, access,
                                     1, "/logs/error.json"));
  std::map<std::string, std::string> want = {{"RANK", "3"},
                                             {"LOCAL_RANK", "1"},
                                             {"WORLD_SIZE", "4"},
                                             {"LOCAL_WORLD_SIZE", "2"},
                                             {"GROUP_RANK", "1"},
                                             {"GROUP_WORLD_SIZE", "2"},
                                             {"ROLE_RANK", "3"},
                                             {"ROLE_WORLD_SIZE", "4"},
                                             {"ROLE_NAME", "default"},
                                             {"MASTER_ADDR", "10.0.0.1"},
                                             {"MASTER_PORT", "41000"},
                                             {"TORCHELASTIC_RESTART_COUNT", "1"},
                                             {"TORCHELASTIC_MAX_RESTARTS", "3"},
                                             {"TORCHELASTIC_RUN_ID", "job7"},
                                             {"TORCHELASTIC_USE_AGENT_STORE", "False"},
                                             {"TORCHELASTIC_ERROR_FILE", "/logs/error.json"},
                                             {"OMP_NUM_THREADS", "1"},
                                             {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
                                             {"MUSTER_RDZV_ENDPOINT", "rdzv:29400"},
                                             {"MUSTER_JOB", "job7"},
                                             {"MUSTER_ROUND", "4"},
                                             {"MUSTER_TOKEN_FILE", "/run/token"},
                                             {"PATH", "/bin"}};
  for (const auto& [key, value] : want) {
    INFO(key);
    CHECK(env[key] == value);
  }
  CHECK(env.count("MUSTER_TLS_CA") == 0);  // not configured: not inherited either
}

TEST_CASE("OMP_NUM_THREADS is left alone when set, or with one worker") {
  RoundAssignment round;
  round.local_world_size = 2;
  auto set = AsMap(WorkerEnvironment({{"OMP_NUM_THREADS", "8"}}, round, {}, 0, "e"));
  CHECK(set["OMP_NUM_THREADS"] == "8");
  round.local_world_size = 1;
  auto single = AsMap(WorkerEnvironment({}, round, {}, 0, "e"));
  CHECK(single.count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("TORCH_NCCL_ASYNC_ERROR_HANDLING is left alone when either of its names is set") {
  RoundAssignment round;
  auto set =
      AsMap(WorkerEnvironment({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}}, round, {}, 0, "e"));
  CHECK(set["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3");
  auto old_name = AsMap(WorkerEnvironment({{"NCCL_ASYNC_ERROR_HANDLING", "0"}}, round, {}, 0, "e"));
  CHECK(old_name.count("TORCH_NCCL_ASYNC_ERROR_HANDLING") == 0);
  CHECK(old_name["NCCL_ASYNC_ERROR_HANDLING"] == "0");
}

TEST_CASE("workers are told their preemption grace") {
  RoundAssignment round;
  CHECK(AsMap(WorkerEnvironment({}, round, {}, 0, "e"))["MUSTER_PREEMPT_GRACE_S"] == "30");
  round.preempt_grace_s = 12.5;
  CHECK(AsMap(WorkerEnvironment({}, round, {}, 0, "e"))["MUSTER_PREEMPT_GRACE_S"] == "12.5");
}

}  // namespace
}  // namespace muster::launcher
