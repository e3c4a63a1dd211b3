#include "tools/server_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace muster::tools {

struct OutputBuffer {
  absl::Mutex mu;
  std::string text ABSL_GUARDED_BY(mu);
};

namespace {

constexpr char kListeningMarker[] = "listening on ";

// The port after the last ':' on the "listening on" line, or 0.
int ParseListeningPort(const std::string& text) {
  size_t at = text.find(kListeningMarker);
  if (at == std::string::npos) return 0;
  size_t end = text.find('\n', at);
  if (end == std::string::npos) return 0;  // line not complete yet
  std::string address =
      text.substr(at + std::strlen(kListeningMarker), end - at - std::strlen(kListeningMarker));
  size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return 0;
  }
  return port;
}

}  // namespace

std::string ExecutableDir() {
  char path[4096];
  ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return ".";
  std::string exe(path, length);
  size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "." : exe.substr(0, slash);
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const ServerProcessOptions& options) {
  if (access(options.binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("rendezvous binary \"", options.binary, "\" is not executable"));
  }
  std::vector<std::string> args = {options.binary, "--listen", options.listen};
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {  // child: async-signal-safe calls only
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);

  std::unique_ptr<ServerProcess> process(new ServerProcess());
  process->pid_ = pid;
  process->output_fd_ = fds[0];
  process->echo_output_ = options.echo_output;
  process->output_ = std::make_shared<OutputBuffer>();

  // Read until the "listening on" line, the child's exit, or the timeout.
  const absl::Time deadline = absl::Now() + options.start_timeout;
  std::string seen;
  char buffer[4096];
  for (;;) {
    int port = ParseListeningPort(seen);
    if (port > 0) {
      process->port_ = port;
      break;
    }
    int wait_ms =
        static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    if (wait_ms == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous server did not print \"", kListeningMarker, "\" within ",
                       absl::FormatDuration(options.start_timeout), "; output:\n", seen));
    }
    pollfd poll_fd{fds[0], POLLIN, 0};
    int ready = poll(&poll_fd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::InternalError(
          absl::StrCat("rendezvous server exited before listening; output:\n", seen));
    }
    seen.append(buffer, n);
    if (options.echo_output) fwrite(buffer, 1, n, stderr);
  }
  {
    absl::MutexLock lock(&process->output_->mu);
    process->output_->text = seen;
  }
  ServerProcess* raw = process.get();
  process->drainer_ = std::thread([raw] { raw->Drain(); });
  return process;
}

void ServerProcess::Drain() {
  char buffer[4096];
  for (;;) {
    ssize_t n = read(output_fd_, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // EOF: the child (and its copies of the pipe) exited
    if (echo_output_) fwrite(buffer, 1, n, stderr);
    absl::MutexLock lock(&output_->mu);
    output_->text.append(buffer, n);
  }
}

ServerProcess::~ServerProcess() {
  if (!reaped_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    int status;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  if (drainer_.joinable()) drainer_.join();
  if (output_fd_ >= 0) close(output_fd_);
}

absl::Status ServerProcess::Kill(int signal) {
  if (reaped_) return absl::OkStatus();
  if (kill(pid_, signal) != 0) {
    return absl::InternalError(
        absl::StrCat("kill(", pid_, ", ", signal, "): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ServerProcess::Wait(absl::Time deadline) {
  for (;;) {
    int status = 0;
    pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      reaped_ = true;
      return status;
    }
    if (done < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("waitpid(", pid_, "): ", std::strerror(errno)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous server pid ", pid_, " still running"));
    }
    // A child exit has no fd to wait on here; poll at a fine grain.
    absl::SleepFor(absl::Milliseconds(5));
  }
}

absl::StatusOr<int64_t> ServerProcess::PeakRssKib() const {
  std::ifstream status_file(absl::StrCat("/proc/", pid_, "/status"));
  std::string line;
  while (std::getline(status_file, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      int64_t kib = 0;
      if (fields >> kib) return kib;
    }
  }
  return absl::NotFoundError(absl::StrCat("no VmHWM in /proc/", pid_, "/status"));
}

std::string ServerProcess::output() const {
  absl::MutexLock lock(&output_->mu);
  return output_->text;
}

}  // namespace muster::tools
