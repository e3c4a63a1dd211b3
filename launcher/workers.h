// One attempt's workers on this node: spawned together, watched together,
// stopped together.
//
// Each worker gets torchrun's environment (worker_env.h), its stdout and
// stderr go through the LogPump to
//   <attempt_dir>/<global_rank>/{stdout.log,stderr.log}
// (as --redirects / --tee ask) and to the console with a
// "[<host> rank<N>]: " prefix, and its TORCHELASTIC_ERROR_FILE is
//   <attempt_dir>/<global_rank>/error.json.
//
// Thread-safety: one thread (the agent's main thread: see process.h on
// PR_SET_PDEATHSIG) owns a WorkerGroup.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "launcher/failures.h"
#include "launcher/log_pump.h"
#include "launcher/options.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"

namespace muster::launcher {

struct WorkerGroupSpec {
  std::vector<std::string> command;  // program and arguments, same for all
  std::map<std::string, std::string> base_env;
  RoundAssignment round;
  RendezvousAccess access;
  std::string attempt_dir;  // created if missing
  std::string host;         // this node's name, for prefixes and reports
  std::map<int, int> redirects;
  std::map<int, int> tee;
  std::vector<int> local_ranks_filter;  // empty: every rank on the console
  // Started blocked in each worker (SpawnSpec::blocked_signals): muster's
  // worker holds its preemption signals until it handles them, so one that
  // comes while it loads is answered, not fatal.
  std::vector<int> blocked_signals;
};

class WorkerGroup {
 public:
  // Spawns round.local_world_size workers. If one cannot be spawned, the
  // ones already started are stopped and the error is returned.
  static absl::StatusOr<std::unique_ptr<WorkerGroup>> Start(const WorkerGroupSpec& spec,
                                                            LogPump* pump);

  // Stops whatever still runs (SIGKILL) before going away.
  ~WorkerGroup();

  // pidfds of the workers still running, to poll on.
  std::vector<int> RunningPidfds() const;

  // Notes the workers that exited (they are reaped by Stop or the
  // destructor, after their process groups are killed). Failures are
  // recorded once each, in the order they were seen.
  void CollectExits();

  int running() const;
  bool all_succeeded() const;  // every worker exited 0
  const std::vector<WorkerFailure>& failures() const { return failures_; }

  // Whether every worker stopped as a preempted worker does: each exited
  // kPreemptedExitCode (it saved its state) or 0, and at least one
  // kPreemptedExitCode. False while any still runs.
  bool preempted() const;
  // "rank 0: exit code 75; rank 1: signal 9 (SIGKILL)", for the log.
  std::string DescribeExits() const;

  // SIGTERM (or `signal`) to every worker, SIGKILL after `timeout`.
  void Stop(absl::Duration timeout, int signal);

  // Waits, signalling none, until every worker has exited or `deadline`
  // passes; then CollectExits.
  void AwaitExits(absl::Time deadline);

 private:
  WorkerGroup() = default;

  struct Worker {
    Child child;
    int local_rank;
    int global_rank;
    std::string error_file;
    std::string stderr_log;  // the file its stderr goes to (--redirects, --tee), or ""
    bool on_console = true;  // false: --local_ranks_filter keeps it off the console
    bool reported = false;
    bool warned_leftovers = false;  // Stop named what it left running
  };
  std::vector<Worker> workers_;
  std::vector<WorkerFailure> failures_;
  std::string host_;
};

// Finds the program that runs the target: our `worker` binary for a yaml
// config (next to `launch`, in bazel-bin's ../worker/, or on PATH),
// python3 -u (or $PYTHON_EXEC) for a script or module, the target itself
// with --no_python (on PATH when it has no '/'), and an executable file
// given without --no_python as a path ("./test"). NOT_FOUND names what is
// missing.
absl::StatusOr<std::vector<std::string>> WorkerCommand(
    const LaunchOptions& options, const std::map<std::string, std::string>& env);

}  // namespace muster::launcher
