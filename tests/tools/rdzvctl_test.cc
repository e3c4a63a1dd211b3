// rdzvctl against a real server holding a real job: two `launch` agents.
#include <unistd.h>

#include <sstream>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

struct Output {
  int exit_code;
  std::string text;
};

Output Rdzvctl(const std::string& endpoint, std::vector<std::string> args) {
  launcher::SpawnSpec spec;
  spec.argv = {BinaryPath("tools/rdzvctl"), "--endpoint", endpoint};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.pipe_stdout = spec.pipe_stderr = true;
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  Output output{-1, ""};
  for (int fd : {child->TakeStdout(), child->TakeStderr()}) {
    char buffer[4096];
    ssize_t got;
    while ((got = read(fd, buffer, sizeof(buffer))) > 0) output.text.append(buffer, got);
    close(fd);
  }
  auto exit = child->WaitFor(absl::Seconds(30));
  REQUIRE(exit.has_value());
  output.exit_code = exit->ShellCode();
  return output;
}

TEST_CASE("rdzvctl lists, describes and closes a running job") {
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> args = {"--nnodes=2",
                                   "--nproc_per_node=2",
                                   "--rdzv_endpoint",
                                   server->endpoint(),
                                   "--rdzv_id=ctl",
                                   "--no_python",
                                   "/bin/sh",
                                   "-c",
                                   "echo up > " + dir.path() + "/up.$RANK; exec sleep 60"};
  launcher::Child first = StartLaunch(args, dir.File("a.log"));
  launcher::Child second = StartLaunch(args, dir.File("b.log"));
  REQUIRE(WaitUntil([&] { return ReadLines(dir.path(), "up.").size() == 4; }, absl::Seconds(30)));

  Output health = Rdzvctl(server->endpoint(), {"health"});
  CHECK(health.exit_code == 0);
  CHECK(health.text.find("SERVING (grpc.health.v1.Health)") != std::string::npos);

  Output list = Rdzvctl(server->endpoint(), {"list"});
  CHECK(list.exit_code == 0);
  CHECK(list.text.find("ctl") != std::string::npos);
  CHECK(list.text.find("RUNNING") != std::string::npos);

  Output describe = Rdzvctl(server->endpoint(), {"describe", "ctl"});
  CHECK(describe.exit_code == 0);
  CHECK(describe.text.find("world size 4") != std::string::npos);
  CHECK(describe.text.find("members (2)") != std::string::npos);

  Output missing = Rdzvctl(server->endpoint(), {"describe", "nope"});
  CHECK(missing.exit_code == 1);
  CHECK(missing.text.find("NOT_FOUND") != std::string::npos);

  Output usage = Rdzvctl(server->endpoint(), {"frobnicate"});
  CHECK(usage.exit_code == 2);

  // An administrator's close ends the job: every agent stops its workers
  // and exits 1.
  Output closed = Rdzvctl(server->endpoint(), {"close", "ctl", "--reason", "maintenance"});
  CHECK(closed.exit_code == 0);
  for (launcher::Child* agent : {&first, &second}) {
    auto exit = agent->WaitFor(absl::Seconds(60));
    REQUIRE(exit.has_value());
    CHECK(exit->ShellCode() == 1);
  }
  const std::string log = ReadFile(dir.File("a.log"));
  INFO(log);
  CHECK(log.find("maintenance") != std::string::npos);
  // The round's end is said as the close, not as a reason left unset.
  CHECK(log.find("END_REASON_UNSPECIFIED") == std::string::npos);
  CHECK(log.find("ended (job CLOSED: maintenance)") != std::string::npos);

  // A finished job is not closed again; exit 1 says it ended before.
  Output again = Rdzvctl(server->endpoint(), {"close", "ctl"});
  INFO(again.text);
  CHECK(again.exit_code == 1);
  CHECK(again.text.find("it has already finished; nothing to close") != std::string::npos);
}

TEST_CASE("rdzvctl health checks grpc.health.v1.Health, which needs no token") {
  TempDir dir;
  WriteFile(dir.File("token"), "ctl-token\n");
  auto server = StartServer({"--token-file", dir.File("token")});

  // The health service is not token-checked (load-balancer probes), while
  // every Rendezvous call is: ListJobs could not stand in for it here.
  Output health = Rdzvctl(server->endpoint(), {"health"});
  INFO(health.text);
  CHECK(health.exit_code == 0);
  CHECK(health.text.find("SERVING (grpc.health.v1.Health)") != std::string::npos);
  Output list = Rdzvctl(server->endpoint(), {"list"});
  CHECK(list.exit_code == 1);
  CHECK(list.text.find("UNAUTHENTICATED") != std::string::npos);
  Output with_token = Rdzvctl(server->endpoint(), {"--token-file", dir.File("token"), "health"});
  CHECK(with_token.exit_code == 0);

  // A server that does not answer: exit 1, naming UNAVAILABLE.
  const std::string endpoint = server->endpoint();
  server.reset();
  Output gone = Rdzvctl(endpoint, {"--timeout", "1", "health"});
  INFO(gone.text);
  CHECK(gone.exit_code == 1);
  CHECK(gone.text.find("UNAVAILABLE") != std::string::npos);
  CHECK(Rdzvctl(endpoint, {"health", "extra"}).exit_code == 2);
}

TEST_CASE("rdzvctl refuses unusable options with exit 2 and one line") {
  TempDir dir;
  // No server is needed: each is refused before a call.
  const std::string endpoint = "127.0.0.1:1";
  for (const std::string timeout : {"0", "-1", "nan", "inf"}) {
    Output refused = Rdzvctl(endpoint, {"--timeout", timeout, "list"});
    INFO(refused.text);
    CHECK(refused.exit_code == 2);
    // CLI11's own range check printed "0 not in range 0.000000 to 1797...",
    // and let NaN through: a call with no deadline.
    CHECK(refused.text.find("--timeout: must be a number of seconds > 0, not '" + timeout + "'") !=
          std::string::npos);
    CHECK(refused.text.find("1797") == std::string::npos);
  }
  // Launch refuses an empty job secret file; rdzvctl took it for none.
  WriteFile(dir.File("empty-secret"), " \n");
  Output empty = Rdzvctl(endpoint, {"--job-secret-file", dir.File("empty-secret"), "list"});
  INFO(empty.text);
  CHECK(empty.exit_code == 2);
  CHECK(empty.text.find("job secret file \"" + dir.File("empty-secret") +
                        "\" is empty; expected a job secret") != std::string::npos);
  // A file that cannot be read says why.
  Output missing = Rdzvctl(endpoint, {"--token-file", dir.File("no-such-token"), "list"});
  CHECK(missing.exit_code == 2);
  CHECK(missing.text.find("cannot read token file '" + dir.File("no-such-token") +
                          "': No such file or directory") != std::string::npos);
  Output directory = Rdzvctl(endpoint, {"--token-file", dir.path(), "list"});
  CHECK(directory.exit_code == 2);
  CHECK(directory.text.find("cannot read token file '" + dir.path() + "': Is a directory") !=
        std::string::npos);
}

TEST_CASE("rdzvctl list and describe count a gathering job's nodes alike") {
  TempDir dir;
  auto server = StartServer();
  // One agent of two: the round gathers, with one node joined.
  launcher::Child agent = StartLaunch(
      {"--nnodes=2", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
       "--rdzv_id=gather", "--rdzv_conf=world_size_multiple=2", "--no_python", "/bin/true"},
      dir.File("agent.log"));
  Output list;
  // No event says the join landed; ask until it shows.
  REQUIRE(WaitUntil(
      [&] {
        list = Rdzvctl(server->endpoint(), {"list"});
        return list.text.find("gather") != std::string::npos;
      },
      absl::Seconds(30)));
  INFO(list.text);
  // JOB PHASE ROUND NODES WORLD WAITING RESTARTS
  std::istringstream row(list.text.substr(list.text.find("gather")));
  std::string job, phase, round, nodes, world, waiting;
  row >> job >> phase >> round >> nodes >> world >> waiting;
  CHECK(phase == "GATHERING");
  CHECK(nodes == "1");
  CHECK(waiting == "0");
  Output describe = Rdzvctl(server->endpoint(), {"describe", "gather"});
  INFO(describe.text);
  CHECK(describe.text.find("nodes:      1 joined of min 2") != std::string::npos);
  CHECK(describe.text.find("(0 waiting, 1 pending)") != std::string::npos);
  // The job's world multiple, and how many waiting nodes a round would add.
  CHECK(describe.text.find("worlds:     multiples of 2; 0 waiting node(s) a new round would "
                           "admit") != std::string::npos);
  agent.KillGroupAndReap(absl::Seconds(10));
}

}  // namespace
}  // namespace muster::testing
