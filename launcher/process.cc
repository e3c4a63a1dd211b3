#include "launcher/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muster::launcher {
namespace {

// glibc 2.36's <sys/pidfd.h> lacks C linkage for C++, so call it directly.
int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

void CloseFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

ExitInfo FromSiginfo(const siginfo_t& info) {
  ExitInfo exit;
  if (info.si_code == CLD_EXITED) {
    exit.exit_code = info.si_status;
  } else {
    exit.signal = info.si_status;
  }
  return exit;
}

// Runs in the forked child before exec: only async-signal-safe calls.
[[noreturn]] void ExecChild(const SpawnSpec& spec, char* const* argv, char* const* envp,
                            pid_t agent_pid, int out_pipe_write, int err_pipe_write,
                            int exec_error_write) {
  if (spec.own_process_group) setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The agent may have died between fork and prctl.
  if (getppid() != agent_pid) _exit(127);
  // Start with the default signal dispositions and the mask asked for (the
  // agent blocks signals it reads through signalfd).
  sigset_t mask;
  sigemptyset(&mask);
  for (int blocked : spec.blocked_signals) sigaddset(&mask, blocked);
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD}) signal(sig, SIG_DFL);
  if (out_pipe_write >= 0) dup2(out_pipe_write, STDOUT_FILENO);
  if (err_pipe_write >= 0) dup2(err_pipe_write, STDERR_FILENO);
  execvpe(argv[0], argv, envp);
  int error = errno;
  ssize_t ignored = write(exec_error_write, &error, sizeof(error));
  (void)ignored;
  _exit(127);
}

}  // namespace

std::string ExitInfo::Describe() const {
  if (signal == 0) return absl::StrCat("exit code ", exit_code);
  const char* name = sigabbrev_np(signal);
  return absl::StrCat("signal ", signal, name ? absl::StrCat(" (SIG", name, ")") : "");
}

absl::StatusOr<Child> Child::Spawn(const SpawnSpec& spec) {
  if (spec.argv.empty()) return absl::InvalidArgumentError("spawn: empty argv");
  // Everything the child needs is built before fork.
  std::vector<char*> argv, envp;
  for (const std::string& arg : spec.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  for (const std::string& var : spec.env) envp.push_back(const_cast<char*>(var.c_str()));
  envp.push_back(nullptr);

  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1}, exec_error[2] = {-1, -1};
  auto close_all = [&] {
    for (int* fds : {out_pipe, err_pipe, exec_error}) {
      CloseFd(fds[0]);
      CloseFd(fds[1]);
    }
  };
  if ((spec.pipe_stdout && pipe2(out_pipe, O_CLOEXEC) != 0) ||
      (spec.pipe_stderr && pipe2(err_pipe, O_CLOEXEC) != 0) || pipe2(exec_error, O_CLOEXEC) != 0) {
    int error = errno;
    close_all();
    return absl::InternalError(absl::StrCat("spawn: pipe: ", strerror(error)));
  }

  pid_t agent_pid = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    int error = errno;
    close_all();
    return absl::InternalError(absl::StrCat("spawn: fork: ", strerror(error)));
  }
  if (pid == 0) {
    ExecChild(spec, argv.data(), envp.data(), agent_pid, out_pipe[1], err_pipe[1], exec_error[1]);
  }
  // Also set the group from the parent, so signalling it cannot race the
  // child's own setpgid.
  if (spec.own_process_group) setpgid(pid, pid);
  CloseFd(out_pipe[1]);
  CloseFd(err_pipe[1]);
  CloseFd(exec_error[1]);

  Child child;
  child.pid_ = pid;
  child.stdout_fd_ = out_pipe[0];
  child.stderr_fd_ = err_pipe[0];
  child.pidfd_ = PidfdOpen(pid);

  // The exec-error pipe closes on a successful exec and carries errno if
  // exec failed.
  int exec_errno = 0;
  ssize_t got;
  do {
    got = read(exec_error[0], &exec_errno, sizeof(exec_errno));
  } while (got < 0 && errno == EINTR);
  CloseFd(exec_error[0]);
  if (got == sizeof(exec_errno)) {
    child.WaitFor(absl::Seconds(5));
    return absl::NotFoundError(
        absl::StrCat("cannot run '", spec.argv[0], "': ", strerror(exec_errno)));
  }
  if (child.pidfd_ < 0) {
    return absl::InternalError(absl::StrCat("spawn: pidfd_open: ", strerror(errno)));
  }
  return child;
}

Child::Child(Child&& other) noexcept { *this = std::move(other); }

Child& Child::operator=(Child&& other) noexcept {
  if (this != &other) {
    Release();
    pid_ = other.pid_;
    pidfd_ = other.pidfd_;
    stdout_fd_ = other.stdout_fd_;
    stderr_fd_ = other.stderr_fd_;
    exit_ = other.exit_;
    reaped_ = other.reaped_;
    other.pid_ = -1;
    other.pidfd_ = other.stdout_fd_ = other.stderr_fd_ = -1;
    other.exit_.reset();
  }
  return *this;
}

Child::~Child() { Release(); }

void Child::Release() {
  if (pid_ > 0) KillGroupAndReap(absl::Seconds(10));
  CloseFd(pidfd_);
  CloseFd(stdout_fd_);
  CloseFd(stderr_fd_);
  pid_ = -1;
}

int Child::TakeStdout() {
  int fd = stdout_fd_;
  stdout_fd_ = -1;
  return fd;
}

int Child::TakeStderr() {
  int fd = stderr_fd_;
  stderr_fd_ = -1;
  return fd;
}

std::optional<ExitInfo> Child::CheckExit() {
  if (exit_.has_value() || pid_ <= 0) return exit_;
  siginfo_t info{};
  if (waitid(P_PID, pid_, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_) {
    exit_ = FromSiginfo(info);
  }
  return exit_;
}

std::optional<ExitInfo> Child::WaitFor(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (!CheckExit().has_value()) {
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return std::nullopt;
    if (pidfd_ < 0) {
      // No pidfd (exec failed before it was opened): block in waitid.
      siginfo_t info{};
      if (waitid(P_PID, pid_, &info, WEXITED | WNOWAIT) == 0) exit_ = FromSiginfo(info);
      return exit_;
    }
    pollfd event{pidfd_, POLLIN, 0};
    poll(&event, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
  }
  return exit_;
}

void Child::SignalGroup(int signal) {
  if (pid_ <= 0 || reaped_) return;
  // The group outlives its leader while the worker's own children run. A
  // child in the agent's group has no group of its own (ESRCH): it alone.
  if (kill(-pid_, signal) != 0 && running()) kill(pid_, signal);
}

std::vector<pid_t> Child::OthersInGroup() const {
  std::vector<pid_t> others;
  if (pid_ <= 0 || reaped_) return others;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator("/proc", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(it->path().filename().string(), &pid) || pid == pid_) continue;
    // /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold
    // spaces and parentheses, so the fields are counted after its last ')'.
    std::ifstream in(it->path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::vector<std::string> fields =
        absl::StrSplit(stat.substr(close + 1), ' ', absl::SkipEmpty());
    pid_t group = 0;
    if (fields.size() > 2 && absl::SimpleAtoi(fields[2], &group) && group == pid_) {
      others.push_back(pid);
    }
  }
  return others;
}

void Child::KillGroupAndReap(absl::Duration timeout) {
  if (pid_ <= 0 || reaped_) return;
  // Unreaped, the leader (running or a zombie) still holds the group id.
  SignalGroup(SIGKILL);
  if (!WaitFor(timeout).has_value()) return;  // unkillable (D state): left
  siginfo_t info{};
  while (waitid(P_PID, pid_, &info, WEXITED) != 0 && errno == EINTR) {
  }
  reaped_ = true;
}

void StopAll(const std::vector<Child*>& children, absl::Duration timeout, int signal) {
  for (Child* child : children) {
    if (child->running()) child->SignalGroup(signal);
  }
  absl::Time deadline = absl::Now() + timeout;
  for (Child* child : children) {
    if (child->running()) child->WaitFor(std::max(deadline - absl::Now(), absl::ZeroDuration()));
  }
  // SIGKILL what is left, leaders and any grandchildren in their groups,
  // then reap: in that order, so no group id can have changed hands.
  for (Child* child : children) child->SignalGroup(SIGKILL);
  for (Child* child : children) child->KillGroupAndReap(absl::Seconds(10));
}

}  // namespace muster::launcher
