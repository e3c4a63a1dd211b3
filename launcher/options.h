// `launch`'s command line: torchrun's flags, defaults and PET_<FLAG>
// environment variables, plus the rendezvous options of our gRPC service.
//
// Every flag accepts both spellings, `--nproc_per_node` and
// `--nproc-per-node`. A flag given on the command line wins over its PET_
// variable, which wins over the default.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muster::launcher {

// What the target names, and so how workers are started.
enum class TargetKind {
  kYamlConfig,    // *.yaml / *.yml: our `worker` binary with that config
  kPythonScript,  // -m module, or any other file that is not executable: python3 -u
  kExecutable,    // --no_python, or an executable file: the target itself
};

// --rdzv_conf k=v,... with torchrun's keys and ours.
struct RdzvConf {
  absl::Duration join_timeout = absl::Seconds(600);
  absl::Duration last_call_timeout = absl::Seconds(30);
  absl::Duration close_timeout = absl::Seconds(30);
  // Our lease ttl. torchrun's `heartbeat_timeout` sets it too.
  absl::Duration lease_ttl = absl::Seconds(10);
  // torchrun's keep-alive: renew every keep_alive_interval, dead after
  // keep_alive_max_attempt missed renewals. ParseRdzvConf resolves them
  // with lease_ttl: given alone, interval x attempts is the ttl; not given,
  // the interval is lease_ttl / keep_alive_max_attempt.
  absl::Duration keep_alive_interval = absl::ZeroDuration();
  int keep_alive_max_attempt = 3;
  std::string token_file;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string job_secret_file;
  // Rounds only of worlds that are a multiple of this (ours; torchrun has
  // none). 0: what a train.yaml target's parallel layout needs, else any.
  uint32_t world_size_multiple = 0;
  // c10d backend: whether this agent hosts the rendezvous (torchrun's
  // `is_host`); unset: it does when the endpoint's host is this machine.
  std::optional<bool> is_host;
};

struct LaunchOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  // nproc_per_node as typed: a number, "auto", "cpu" or "gpu"; see
  // ResolveNprocPerNode.
  std::string nproc_per_node = "1";
  int node_rank = -1;  // static mode; -1 lets the rendezvous choose
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  // grpc: the muster service at rdzv_endpoint; c10d: the same service,
  // hosted by the agent on the endpoint's machine (torchrun's c10d);
  // static: node 0 hosts it at master_addr:master_port. Not given: grpc
  // with an rdzv_endpoint, static without (torchrun's default).
  std::string rdzv_backend = "grpc";
  std::string rdzv_endpoint;  // host[:port], port default 29400
  std::string rdzv_id = "none";
  RdzvConf rdzv_conf;
  bool standalone = false;

  int max_restarts = 0;
  absl::Duration monitor_interval = absl::Milliseconds(100);
  std::string role = "default";

  std::string log_dir;
  // Per local rank: 0 none, 1 stdout, 2 stderr, 3 both. A key of -1 holds
  // the value for every rank not listed.
  std::map<int, int> redirects = {{-1, 0}};
  std::map<int, int> tee = {{-1, 0}};
  std::vector<int> local_ranks_filter;  // empty: all ranks

  bool no_python = false;
  bool run_module = false;  // -m: the target is a Python module
  // torchrun's --start_method (spawn, fork or forkserver) and --run_path
  // choose how its workers run a Python function entry point. Every worker
  // here is a fresh process running the target, which is what torchrun does
  // for a script in all of them, so both are checked and recorded only.
  std::string start_method = "spawn";
  bool run_path = false;
  std::string local_addr;
  absl::Duration shutdown_timeout = absl::Seconds(30);
  // How long workers get to save their state after a preemption signal
  // (SIGTERM, SIGUSR1) before SIGKILL; replaces shutdown_timeout then.
  absl::Duration preempt_grace = absl::Seconds(30);
  std::vector<int> signals_to_handle;  // SIGTERM, SIGINT, SIGHUP, SIGQUIT

  std::string target;
  std::vector<std::string> target_args;
  TargetKind target_kind = TargetKind::kExecutable;
};

// Parses argv (argv[0] is the program). `env` supplies PET_* variables.
// Errors are INVALID_ARGUMENT with one line naming the flag and the value
// expected; `launch` prints it and exits 2. `--help` yields CANCELLED with
// the help text as the message (print it, exit 0).
absl::StatusOr<LaunchOptions> ParseLaunchOptions(const std::vector<std::string>& argv,
                                                 const std::map<std::string, std::string>& env);

// Parses `N` or `MIN:MAX` (1 <= MIN <= MAX).
absl::Status ParseNnodes(const std::string& text, int* min_nodes, int* max_nodes);

// Parses `k=v,k=v` into `conf`. Unknown keys are INVALID_ARGUMENT.
absl::Status ParseRdzvConf(const std::string& text, RdzvConf* conf);

// Parses "3" (every rank) or "0:1,1:2" (per local rank) for -r / -t.
absl::StatusOr<std::map<int, int>> ParseStdStreams(const std::string& text);

// The stream setting that applies to `local_rank`.
int StreamsFor(const std::map<int, int>& setting, int local_rank);

// Resolves "auto"/"gpu"/"cpu"/N to a count. `gpu_count` is the number of
// CUDA devices visible (0 when there is no CUDA runtime or device);
// `cpu_count` the CPUs this process may run on. "gpu" with no GPU is
// FAILED_PRECONDITION.
absl::StatusOr<int> ResolveNprocPerNode(const std::string& text, int gpu_count, int cpu_count);

}  // namespace muster::launcher
