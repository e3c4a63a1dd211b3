// The `rendezvous` binary itself, as an operator runs it: the signals it
// takes, and the one line and exit 2 of a start it refuses.
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

struct Output {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `rendezvous` with `args` to its end, which a refused start reaches
// at once; one that serves is killed after 30 s and fails the test.
Output RunRendezvous(const std::vector<std::string>& args) {
  launcher::SpawnSpec spec;
  spec.argv = {BinaryPath("rendezvous/rendezvous")};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.pipe_stdout = spec.pipe_stderr = true;
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  Output output;
  pollfd fds[2] = {{child->TakeStdout(), POLLIN, 0}, {child->TakeStderr(), POLLIN, 0}};
  std::string* texts[2] = {&output.out, &output.err};
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((fds[0].fd >= 0 || fds[1].fd >= 0) && absl::Now() < deadline) {
    if (poll(fds, 2, 100) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[4096];
      ssize_t got = read(fds[i].fd, buffer, sizeof(buffer));
      if (got > 0) {
        texts[i]->append(buffer, got);
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;  // poll skips it
      }
    }
  }
  for (const pollfd& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  std::optional<launcher::ExitInfo> exit = child->WaitFor(absl::Seconds(1));
  if (!exit.has_value()) child->KillGroupAndReap(absl::Seconds(5));
  REQUIRE(exit.has_value());
  output.exit_code = exit->ShellCode();
  return output;
}

TEST_CASE("SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored; SIGTERM still stops it") {
  TempDir dir;
  auto server = StartServer({"--log-level", "info", "--state-dir", dir.path()});
  // Each killed the server outright (exit 129, 138), with no log line.
  for (auto [signal_number, name] : {std::pair{SIGHUP, "SIGHUP"}, std::pair{SIGUSR1, "SIGUSR1"},
                                     std::pair{SIGUSR2, "SIGUSR2"}}) {
    REQUIRE(server->Kill(signal_number).ok());
    const std::string line = absl::StrCat(name, " received and ignored");
    // The server's log is the only sign it took the signal.
    CHECK(WaitUntil([&] { return server->output().find(line) != std::string::npos; },
                    absl::Seconds(10)));
  }
  REQUIRE(server->Kill(SIGTERM).ok());
  absl::StatusOr<int> status = server->Wait(absl::Now() + absl::Seconds(20));
  REQUIRE(status.ok());
  INFO(server->output());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
  CHECK(server->output().find("SIGTERM received, shutting down") != std::string::npos);
}

TEST_CASE("a flag out of its range says the bound, in one line") {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  // CLI11's range check printed "Value 0 not in range 0.000000 to 1797..."
  // (310 digits), and let NaN through.
  for (const Case& c : std::vector<Case>{
           {{"--max-jobs", "0"}, "--max-jobs: must be a number > 0, not '0'"},
           {{"--credentials-refresh", "0"}, "--credentials-refresh: must be a number > 0"},
           {{"--credentials-refresh", "nan"}, "--credentials-refresh: must be a number > 0"},
           {{"--closed-retention", "-1"}, "--closed-retention: must be a number >= 0, not '-1'"},
           {{"--closed-retention", "nan"}, "--closed-retention: must be a number >= 0"},
           {{"--idle-retention", "-1"}, "--idle-retention: must be a number >= 0, not '-1'"},
           {{"--max-join-timeout-ms", "0"}, "--max-join-timeout-ms: must be a number > 0"}}) {
    Output refused = RunRendezvous(c.args);
    INFO(refused.err);
    CHECK(refused.exit_code == 2);
    CHECK(refused.err.find(c.expected) != std::string::npos);
    CHECK(refused.err.find("1797") == std::string::npos);
    CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
  }
}

TEST_CASE("a --listen that cannot be bound is one line with its cause") {
  int taken = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(taken >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(taken, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(listen(taken, 1) == 0);
  socklen_t length = sizeof(address);
  REQUIRE(getsockname(taken, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  const std::string in_use = absl::StrCat("127.0.0.1:", ntohs(address.sin_port));

  struct Case {
    std::string listen;
    std::string expected;
  };
  // gRPC's multi-line log entry came first, then a guess at the cause.
  for (const Case& c : std::vector<Case>{
           {in_use, "cannot listen on '" + in_use + "': Address already in use"},
           // TEST-NET-3: an address no interface here holds.
           {"203.0.113.7:0", "cannot listen on '203.0.113.7:0': Cannot assign requested address"},
           {"no-such-host.invalid:0",
            "cannot listen on 'no-such-host.invalid:0': cannot resolve "
            "'no-such-host.invalid': "}}) {
    Output refused = RunRendezvous({"--listen", c.listen});
    INFO(refused.err);
    CHECK(refused.exit_code == 2);
    CHECK(refused.err.find("rendezvous: cannot start: " + c.expected) == 0);
    CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
  }
  close(taken);
}

}  // namespace
}  // namespace muster::testing
