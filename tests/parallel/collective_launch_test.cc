// Real processes: `launch --standalone --nproc_per_node=3` runs
// collective_rank, which bootstraps from launch's environment through the
// rendezvous round store. One rank is SIGKILLed mid-loop; the survivors must
// fail on their own (UNAVAILABLE, naming the connection) well within the
// communication timeout, and the restarted job must succeed.
#include <signal.h>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

bool AllExist(const TempDir& dir, const std::string& prefix, int ranks) {
  for (int rank = 0; rank < ranks; ++rank) {
    if (!Exists(dir.File(absl::StrCat(prefix, rank)))) return false;
  }
  return true;
}

std::vector<std::string> Launch(const TempDir& dir, std::vector<std::string> launch_args,
                                const std::vector<std::string>& worker_args) {
  launch_args.insert(launch_args.end(),
                     {"--log_dir", dir.File("logs"), "--no_python",
                      BinaryPath("tests/parallel/collective_rank"), "--dir=" + dir.path()});
  launch_args.insert(launch_args.end(), worker_args.begin(), worker_args.end());
  return launch_args;
}

TEST_CASE("three ranks under launch run every collective with exact results") {
  TempDir dir;
  launcher::Child agent =
      StartLaunch(Launch(dir, {"--standalone", "--nproc_per_node=3"}, {"--iterations=20"}),
                  dir.File("agent.log"));
  auto exit = agent.WaitFor(absl::Seconds(60));
  REQUIRE(exit.has_value());
  INFO(ReadFile(dir.File("agent.log")));
  CHECK(exit->ShellCode() == 0);
  CHECK(AllExist(dir, "done.0.", 3));
}

TEST_CASE("a rank killed mid-loop: survivors fail fast naming the connection, the job restarts") {
  TempDir dir;
  const absl::Duration comm_timeout = absl::Seconds(20);
  launcher::Child agent = StartLaunch(
      Launch(dir,
             {"--standalone", "--nproc_per_node=3", "--max_restarts=1", "--shutdown_timeout=5"},
             {"--first_attempt_loops", "--iterations=10"}),
      dir.File("agent.log"),
      {absl::StrCat("MUSTER_COMM_TIMEOUT_S=", absl::ToInt64Seconds(comm_timeout))});
  REQUIRE(WaitUntil([&] { return AllExist(dir, "looping.0.", 3); }, absl::Seconds(60)));

  int victim = 0;
  REQUIRE(absl::SimpleAtoi(ReadFile(dir.File("pid.0.1")), &victim));
  const absl::Time killed = absl::Now();
  REQUIRE(kill(victim, SIGKILL) == 0);

  // Both survivors report the broken connection themselves, long before
  // the communication timeout could have fired.
  bool reported =
      WaitUntil([&] { return Exists(dir.File("error.0.0")) && Exists(dir.File("error.0.2")); },
                comm_timeout / 2);
  INFO(ReadFile(dir.File("agent.log")));
  REQUIRE(reported);
  CHECK(absl::Now() - killed < absl::Seconds(5));
  for (const char* survivor : {"error.0.0", "error.0.2"}) {
    std::string error = ReadFile(dir.File(survivor));
    INFO(survivor << ": " << error);
    CHECK(absl::StartsWith(error, "UNAVAILABLE"));
    // gloo names the connection by the peer's address ("Connection closed
    // by peer [ip]:port" or "Read error [ip]:port: Connection reset by peer").
    CHECK(absl::StrContains(error, "by peer"));
    CHECK(absl::StrContains(error, "[127.0.0.1]:"));
  }

  auto exit = agent.WaitFor(absl::Seconds(60));
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == 0);
  CHECK(AllExist(dir, "done.1.", 3));  // the restarted attempt ran to the end
}

}  // namespace
}  // namespace muster::testing
