// The environment each worker starts with: torchrun's variables, so an
// unmodified PyTorch script runs, plus muster's own.
#pragma once

#include <array>
#include <csignal>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace muster::launcher {

// The exit code of a worker that was preempted (SIGTERM, or a signal launch
// forwards) and saved a checkpoint of its last step: EX_TEMPFAIL, "try
// again later". The contract between launch and its workers: launch
// reports such an exit as "preempted", not as a failure, and exits with
// it itself so a Slurm or Kubernetes wrapper can requeue the job.
inline constexpr int kPreemptedExitCode = 75;

// The signals muster's worker answers that way (SIGTERM from a scheduler or
// the agent, SIGUSR1 from schedulers that warn with it). It holds them
// blocked from its first instruction until it handles them, and the agent
// starts it with them blocked, so one that comes while it loads is
// answered, never fatal.
inline constexpr std::array<int, 2> kPreemptionSignals = {SIGTERM, SIGUSR1};

// The exit code of a worker whose failure no restart can mend (a config or
// input error, a full disk) and which could not say so in its error file
// (TORCHELASTIC_ERROR_FILE on a full disk, say): EX_CONFIG. A worker that
// exits with it and leaves no error file fails the job at once, as its
// error file's "restartable": "false" would (failures.h). An error file
// that was written decides instead.
inline constexpr int kNotRestartableExitCode = 78;

// What the agent knows once a round has formed.
struct RoundAssignment {
  uint64_t round = 0;
  int group_rank = 0;        // this node's rank
  int group_world_size = 1;  // nodes in the round
  int rank_offset = 0;       // global rank of this node's local rank 0
  int local_world_size = 1;  // workers on this node
  int world_size = 1;        // workers in the round
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;  // the rendezvous job id
  std::string role = "default";
  // Not the round's but the agent's setting, passed on to every worker
  // (MUSTER_PREEMPT_GRACE_S): the seconds between a forwarded preemption
  // signal and SIGKILL.
  double preempt_grace_s = 30;
};

// How workers reach the rendezvous service themselves. Secrets travel as
// file paths, never as values, so they do not show in /proc/<pid>/environ.
struct RendezvousAccess {
  std::string endpoint;
  std::string token_file;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string job_secret_file;
};

// Returns "KEY=VALUE" entries: `base` (the agent's environment) with the
// worker's variables set on top. OMP_NUM_THREADS=1 is added when `base`
// has none and local_world_size > 1.
std::vector<std::string> WorkerEnvironment(const std::map<std::string, std::string>& base,
                                           const RoundAssignment& round,
                                           const RendezvousAccess& access, int local_rank,
                                           const std::string& error_file);

// The process environment as a map.
std::map<std::string, std::string> CurrentEnvironment();

}  // namespace muster::launcher
