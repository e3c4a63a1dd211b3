// Worker processes: spawn, signal, reap.
//
// Every worker runs in its own process group (so a signal reaches the
// worker's own children too; SpawnSpec::own_process_group says when not)
// with PR_SET_PDEATHSIG=SIGKILL, so it dies when
// its agent dies, even by SIGKILL. Exits are noticed through a pidfd, which
// callers poll alongside their other events: nothing sleeps waiting for a
// child.
//
// PR_SET_PDEATHSIG fires when the *thread* that forked exits, so spawn from
// a thread that lives as long as the agent (its main thread).
//
// Thread-safety: a Child is used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muster::launcher {

struct SpawnSpec {
  std::vector<std::string> argv;  // argv[0] is looked up on PATH if it has no '/'
  std::vector<std::string> env;   // the whole environment, "KEY=VALUE"
  // Where the child's stdout / stderr go: a pipe the caller reads
  // (Child::stdout_fd / stderr_fd), or the agent's own stream.
  bool pipe_stdout = false;
  bool pipe_stderr = false;
  // Signals the child starts with blocked (held pending, not lost, until it
  // unblocks them); every other signal starts unblocked.
  std::vector<int> blocked_signals;
  // false: the child stays in the agent's process group, so that it can
  // read the terminal the agent is the foreground of (a process group in
  // the background is stopped by SIGTTIN when it reads it); SignalGroup
  // then reaches the child alone, not its own children.
  bool own_process_group = true;
};

struct ExitInfo {
  int exit_code = 0;  // valid when signal == 0
  int signal = 0;     // the signal that killed it, or 0

  // What a shell reports: the exit code, or 128 + signal.
  int ShellCode() const { return signal != 0 ? 128 + signal : exit_code; }
  bool Succeeded() const { return signal == 0 && exit_code == 0; }
  std::string Describe() const;  // "exit code 3" / "signal 9 (SIGKILL)"
};

class Child {
 public:
  // Forks and execs. Errors: NOT_FOUND if argv[0] cannot be executed (the
  // exec failure is reported back through a close-on-exec pipe, so this is
  // known before Spawn returns), INTERNAL for fork/pidfd failures.
  static absl::StatusOr<Child> Spawn(const SpawnSpec& spec);

  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // KillGroupAndReap: no zombie, and no orphan in its group, outlives the
  // Child.
  ~Child();

  pid_t pid() const { return pid_; }
  // Readable (POLLIN) once the child has exited.
  int pidfd() const { return pidfd_; }
  // Read ends of the pipes, -1 unless requested. The caller takes ownership.
  int TakeStdout();
  int TakeStderr();

  // Notices an exit without blocking: the exit, or nullopt if still
  // running. The exited child is not reaped: as a zombie it keeps its pid,
  // and so its process group id, from going to another process until
  // KillGroupAndReap, which may still signal that group.
  std::optional<ExitInfo> CheckExit();
  // Blocks until the child exits or `timeout` passes (nullopt). Does not
  // reap either.
  std::optional<ExitInfo> WaitFor(absl::Duration timeout);
  const std::optional<ExitInfo>& exit_info() const { return exit_; }
  bool running() const { return pid_ > 0 && !exit_.has_value(); }

  // Sends `signal` to the child's whole process group. Does nothing once
  // the child is reaped: its group id may belong to another process then.
  void SignalGroup(int signal);

  // The processes other than the child in its process group (its own
  // children it left running), from /proc; none once it is reaped, or when
  // it runs in the agent's group.
  std::vector<pid_t> OthersInGroup() const;

  // SIGKILLs the child's process group (the child, if still running, and
  // whatever of its own children are left in it), waits up to `timeout`
  // for the child to die, and reaps it.
  void KillGroupAndReap(absl::Duration timeout);

 private:
  Child() = default;
  void Release();

  pid_t pid_ = -1;
  int pidfd_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::optional<ExitInfo> exit_;
  bool reaped_ = false;
};

// Stops every running child: SIGTERM to each group, wait up to `timeout`
// for all of them, then SIGKILL every group (leaders left running, and
// their children left behind) and reap them. Each group is signalled
// before its leader is reaped, never after. Returns when every child is
// reaped. `signal` replaces SIGTERM for the first stage (the agent
// forwards the signal it received).
void StopAll(const std::vector<Child*>& children, absl::Duration timeout, int signal);

}  // namespace muster::launcher
