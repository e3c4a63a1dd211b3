// Runs the `rendezvous` binary as a child process, for the benchmark and the
// end-to-end tests: start it, learn its port from the "rendezvous:
// listening on <addr>:<port>" line, signal it, and always reap it.
//
// The child's stdout and stderr go to one pipe that a thread drains (and
// echoes to our stderr with a "[rendezvous] " prefix when asked), so the
// child never blocks on a full pipe. The child gets SIGKILL if this process
// dies first (PR_SET_PDEATHSIG).
//
// Thread-safety: none; use one ServerProcess from one thread.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muster::tools {

struct ServerProcessOptions {
  std::string binary;                   // path of the `rendezvous` binary
  std::string listen = "127.0.0.1:0";   // passed as --listen; port 0: any
  std::vector<std::string> extra_args;  // e.g. {"--state-dir", dir}
  absl::Duration start_timeout = absl::Seconds(30);
  bool echo_output = false;
};

class ServerProcess {
 public:
  // Starts the binary and waits for its "listening on" line. Errors:
  // NOT_FOUND if the binary is missing; DEADLINE_EXCEEDED or INTERNAL
  // (with the child's output) if it does not come up.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const ServerProcessOptions& options);

  // Kills (SIGKILL) and reaps the child if it is still running.
  ~ServerProcess();

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

  // Sends `signal` to the child (no-op once reaped).
  absl::Status Kill(int signal);

  // Reaps the child; DEADLINE_EXCEEDED if it is still running at
  // `deadline`. Returns the raw wait status.
  absl::StatusOr<int> Wait(absl::Time deadline);

  // Peak resident set (VmHWM) in KiB while the child runs.
  absl::StatusOr<int64_t> PeakRssKib() const;

  // Everything the child printed so far.
  std::string output() const;

 private:
  ServerProcess() = default;
  void Drain();

  pid_t pid_ = -1;
  bool reaped_ = false;
  int port_ = 0;
  int output_fd_ = -1;
  bool echo_output_ = false;
  std::shared_ptr<struct OutputBuffer> output_;
  std::thread drainer_;
};

// The directory holding the running executable (from /proc/self/exe).
std::string ExecutableDir();

}  // namespace muster::tools
