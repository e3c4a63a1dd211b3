#include "launcher/worker_env.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace muster::launcher {

std::vector<std::string> WorkerEnvironment(const std::map<std::string, std::string>& base,
                                           const RoundAssignment& round,
                                           const RendezvousAccess& access, int local_rank,
                                           const std::string& error_file) {
  std::map<std::string, std::string> env = base;
  int rank = round.rank_offset + local_rank;
  auto set = [&](const std::string& key, const auto& value) { env[key] = absl::StrCat(value); };
  set("RANK", rank);
  set("LOCAL_RANK", local_rank);
  set("WORLD_SIZE", round.world_size);
  set("LOCAL_WORLD_SIZE", round.local_world_size);
  set("GROUP_RANK", round.group_rank);
  set("GROUP_WORLD_SIZE", round.group_world_size);
  // One role per job: role ranks are the global ranks.
  set("ROLE_RANK", rank);
  set("ROLE_WORLD_SIZE", round.world_size);
  set("ROLE_NAME", round.role);
  set("MASTER_ADDR", round.master_addr);
  set("MASTER_PORT", round.master_port);
  set("TORCHELASTIC_RESTART_COUNT", round.restart_count);
  set("TORCHELASTIC_MAX_RESTARTS", round.max_restarts);
  set("TORCHELASTIC_RUN_ID", round.run_id);
  // The agent hosts no TCPStore: rank 0's init_process_group hosts it on
  // MASTER_ADDR:MASTER_PORT.
  set("TORCHELASTIC_USE_AGENT_STORE", "False");
  set("TORCHELASTIC_ERROR_FILE", error_file);
  if (env.find("OMP_NUM_THREADS") == env.end() && round.local_world_size > 1) {
    set("OMP_NUM_THREADS", 1);
  }
  // As torchrun: a PyTorch worker whose NCCL collective fails or times out
  // tears itself down (1) instead of hanging, so the agent sees it exit and
  // restarts the round. Left alone when either name of it is set (older
  // PyTorch reads NCCL_ASYNC_ERROR_HANDLING).
  if (env.find("TORCH_NCCL_ASYNC_ERROR_HANDLING") == env.end() &&
      env.find("NCCL_ASYNC_ERROR_HANDLING") == env.end()) {
    set("TORCH_NCCL_ASYNC_ERROR_HANDLING", 1);
  }
  set("MUSTER_RDZV_ENDPOINT", access.endpoint);
  set("MUSTER_JOB", round.run_id);
  set("MUSTER_ROUND", round.round);
  set("MUSTER_PREEMPT_GRACE_S", round.preempt_grace_s);
  auto set_if = [&](const std::string& key, const std::string& value) {
    if (value.empty()) {
      env.erase(key);
    } else {
      env[key] = value;
    }
  };
  set_if("MUSTER_TOKEN_FILE", access.token_file);
  set_if("MUSTER_TLS_CA", access.tls_ca);
  set_if("MUSTER_TLS_CERT", access.tls_cert);
  set_if("MUSTER_TLS_KEY", access.tls_key);
  set_if("MUSTER_JOB_SECRET_FILE", access.job_secret_file);

  std::vector<std::string> entries;
  entries.reserve(env.size());
  for (const auto& [key, value] : env) entries.push_back(key + "=" + value);
  return entries;
}

std::map<std::string, std::string> CurrentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text(*entry);
    size_t equals = text.find('=');
    if (equals != std::string::npos) env[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return env;
}

}  // namespace muster::launcher
