// `launch`: the per-node agent, a drop-in for torchrun. See agent.h.
#include <signal.h>
#include <sys/signalfd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "launcher/agent.h"
#include "launcher/options.h"
#include "launcher/worker_env.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  using namespace muster::launcher;
  std::map<std::string, std::string> env = CurrentEnvironment();
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchOptions(std::vector<std::string>(argv, argv + argc), env);
  if (absl::IsCancelled(options.status())) {  // --help
    std::fputs(std::string(options.status().message()).c_str(), stdout);
    return 0;
  }
  if (!options.ok()) {
    std::fprintf(stderr, "launch: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  // The agent's own lines go to stderr, as torchrun's (Python's logging)
  // do: stdout carries only what the workers print.
  spdlog::set_default_logger(spdlog::stderr_color_mt("launch"));
  spdlog::set_pattern("[launch %H:%M:%S.%e %^%l%$] %v");

  // The handled signals are read from a signalfd by the agent's signal
  // watch (signal_watch.h). They are blocked before any thread starts, so
  // every thread inherits the mask and none of them takes the signal
  // instead. Workers reset their mask.
  sigset_t handled;
  sigemptyset(&handled);
  for (int signal_number : options->signals_to_handle) sigaddset(&handled, signal_number);
  sigprocmask(SIG_BLOCK, &handled, nullptr);
  int signal_fd = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd < 0) {
    std::perror("launch: signalfd");
    return 1;
  }
  // A worker's closed pipe must not kill the agent.
  signal(SIGPIPE, SIG_IGN);
  return RunAgent(*options, env, signal_fd);
}
