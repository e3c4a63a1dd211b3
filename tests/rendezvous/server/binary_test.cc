// The `rendezvous` binary itself, as an operator runs it: the signals it
// takes.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

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

}  // namespace
}  // namespace muster::testing
