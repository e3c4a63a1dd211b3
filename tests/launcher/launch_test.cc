// `launch` as users run it: real agents, real workers (shell scripts), a
// real `rendezvous` server, all on 127.0.0.1. Processes are killed for
// real and /proc is checked for leftovers.
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/endpoint.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

using launcher::Child;

std::map<std::string, std::string> ParseEnv(const std::string& text) {
  std::map<std::string, std::string> env;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    env[kv.first] = kv.second;
  }
  return env;
}

int ExitCodeWithin(Child& child, absl::Duration timeout) {
  auto exit = child.WaitFor(timeout);
  REQUIRE(exit.has_value());
  return exit->ShellCode();
}

// Worker scripts run by `launch --no_python /bin/sh -c SCRIPT`.
std::vector<std::string> ShellWorker(const std::string& script) {
  return {"--no_python", "/bin/sh", "-c", script};
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_CASE("two agents with two workers each give every worker torchrun's environment") {
  TempDir dir;
  WriteFile(dir.File("token"), "s3cret-token\n");
  auto server = StartServer({"--token-file", dir.File("token")});
  std::vector<std::string> args = {
      "--nnodes=2",       "--nproc-per-node=2", "--rdzv_endpoint",
      server->endpoint(), "--rdzv_id=envjob",   "--rdzv_conf=token_file=" + dir.File("token"),
      "--log_dir",        dir.File("logs"),     "--tee=3"};
  std::string script = "env > " + dir.path() + "/env.$RANK; echo hello from $RANK";
  // NCCL's settings reach the workers unchanged, as under torchrun.
  const std::vector<std::string> node_env = {"CUDA_VISIBLE_DEVICES=0,1",
                                             "NCCL_SOCKET_IFNAME=eth0,ib0", "NCCL_IB_HCA=mlx5_0:1",
                                             "NCCL_DEBUG_SUBSYS=INIT,NET"};
  Child first = StartLaunch(Concat(args, ShellWorker(script)), dir.File("agent0.log"), node_env);
  Child second = StartLaunch(Concat(args, ShellWorker(script)), dir.File("agent1.log"), node_env);
  CHECK(ExitCodeWithin(first, absl::Seconds(60)) == 0);
  CHECK(ExitCodeWithin(second, absl::Seconds(60)) == 0);

  std::set<std::string> master_ports;
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank " << rank);
    std::string text = ReadFile(dir.File(absl::StrCat("env.", rank)));
    REQUIRE_FALSE(text.empty());
    CHECK(text.find("s3cret-token") == std::string::npos);  // token files, not tokens
    auto env = ParseEnv(text);
    int group_rank = rank / 2;
    CHECK(env["RANK"] == absl::StrCat(rank));
    CHECK(env["LOCAL_RANK"] == absl::StrCat(rank % 2));
    CHECK(env["WORLD_SIZE"] == "4");
    CHECK(env["LOCAL_WORLD_SIZE"] == "2");
    CHECK(env["GROUP_RANK"] == absl::StrCat(group_rank));
    CHECK(env["GROUP_WORLD_SIZE"] == "2");
    CHECK(env["ROLE_RANK"] == absl::StrCat(rank));
    CHECK(env["ROLE_WORLD_SIZE"] == "4");
    CHECK(env["ROLE_NAME"] == "default");
    CHECK(env["MASTER_ADDR"] == "127.0.0.1");
    master_ports.insert(env["MASTER_PORT"]);
    CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "0");
    CHECK(env["TORCHELASTIC_MAX_RESTARTS"] == "0");
    CHECK(env["TORCHELASTIC_RUN_ID"] == "envjob");
    CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "False");
    CHECK(env["TORCHELASTIC_ERROR_FILE"] ==
          absl::StrCat(dir.File("logs"), "/envjob/attempt_0/", rank, "/error.json"));
    CHECK(env["OMP_NUM_THREADS"] == "1");
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "0,1");
    CHECK(env["NCCL_SOCKET_IFNAME"] == "eth0,ib0");
    CHECK(env["NCCL_IB_HCA"] == "mlx5_0:1");
    CHECK(env["NCCL_DEBUG_SUBSYS"] == "INIT,NET");
    CHECK(env["MUSTER_RDZV_ENDPOINT"] == server->endpoint());
    CHECK(env["MUSTER_JOB"] == "envjob");
    CHECK(env["MUSTER_ROUND"] == "0");
    CHECK(env["MUSTER_TOKEN_FILE"] == dir.File("token"));
    CHECK(ReadFile(absl::StrCat(dir.File("logs"), "/envjob/attempt_0/", rank, "/stdout.log")) ==
          absl::StrCat("hello from ", rank, "\n"));
  }
  CHECK(master_ports.size() == 1);
  std::string console = ReadFile(dir.File("agent0.log")) + ReadFile(dir.File("agent1.log"));
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(console.find(absl::StrCat(" rank", rank, "]: hello from ", rank)) != std::string::npos);
  }
}

TEST_CASE("a failed worker restarts the job until the budget is spent") {
  TempDir dir;
  SECTION("a failure in attempt 0, success in attempt 1: exit 0") {
    Child agent = StartLaunch(
        Concat(
            {"--standalone", "--nproc_per_node=2", "--max_restarts=1"},
            ShellWorker("echo $TORCHELASTIC_RESTART_COUNT >> " + dir.path() +
                        "/runs.$RANK; "
                        "[ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ] && exit 5; exit 0")),
        dir.File("agent.log"));
    CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 0);
    // Rank 0 of attempt 0 may be stopped before it writes; attempt 1 ran
    // to the end on both ranks.
    std::string rank0 = ReadFile(dir.File("runs.0"));
    CHECK((rank0 == "0\n1\n" || rank0 == "1\n"));
    CHECK(ReadFile(dir.File("runs.1")) == "0\n1\n");
  }
  // Rank 1 writes `error_json` to its error file and exits `code` (7);
  // rank 0 waits. Each run appends a line to runs.$RANK.
  auto start_failing_rank1 = [&](const std::string& error_json, int max_restarts, int code = 7) {
    return StartLaunch(
        Concat(
            {"--standalone", "--nproc_per_node=2", absl::StrCat("--max_restarts=", max_restarts)},
            ShellWorker(absl::StrCat("echo run >> ", dir.path(),
                                     "/runs.$RANK; "
                                     "if [ $RANK = 1 ]; then echo '",
                                     error_json, "' > $TORCHELASTIC_ERROR_FILE; exit ", code,
                                     "; fi; exec sleep 30"))),
        dir.File("agent.log"));
  };
  SECTION("the budget spent: the agent exits with the worker's own code and its message") {
    Child agent = start_failing_rank1(
        R"({"message": {"message": "ValueError: rank one is unhappy", "extraInfo": {}}})", 1);
    CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 7);
    CHECK(ReadFile(dir.File("runs.1")) == "run\nrun\n");
    std::string console = ReadFile(dir.File("agent.log"));
    CHECK(console.find("ValueError: rank one is unhappy") != std::string::npos);
    CHECK(console.find("exit code 7") != std::string::npos);
  }
  SECTION("exit code 78 and no error file (a full disk): the job fails at once") {
    Child agent = StartLaunch(
        Concat({"--standalone", "--nproc_per_node=2", "--max_restarts=3"},
               ShellWorker("echo run >> " + dir.path() +
                           "/runs.$RANK; if [ $RANK = 1 ]; then exit 78; fi; exec sleep 30")),
        dir.File("agent.log"));
    CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 78);
    CHECK(ReadFile(dir.File("runs.1")) == "run\n");  // not restarted, 3 restarts left
    std::string console = ReadFile(dir.File("agent.log"));
    INFO(console);
    CHECK(absl::StrContains(console, "rank 1's exit code 78 says no restart can mend its failure"));
    CHECK(absl::StrContains(console, "failed without a restart (0 of 3 used)"));
  }
  SECTION("exit code 78 beside an error file that does not say so: the file decides") {
    Child agent = start_failing_rank1(
        R"({"message": {"message": "ValueError: rank one is unhappy", "extraInfo": {}}})", 1, 78);
    CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 78);
    CHECK(ReadFile(dir.File("runs.1")) == "run\nrun\n");  // restarted once
  }
  SECTION("an error file that says no restart can mend it: the job fails at once") {
    Child agent = start_failing_rank1(
        R"({"message": {"message": "config: bad key", "extraInfo": {"restartable": "false"}}})", 3);
    CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 7);
    CHECK(ReadFile(dir.File("runs.1")) == "run\n");  // not restarted, 3 restarts left
    std::string console = ReadFile(dir.File("agent.log"));
    INFO(console);
    CHECK(console.find("rank 1's error file says no restart can mend its failure") !=
          std::string::npos);
    CHECK(console.find("failed without a restart (0 of 3 used), since no restart can mend this "
                       "failure") != std::string::npos);
  }
}

std::vector<int> Pids(const TempDir& dir, int count) {
  std::vector<int> pids;
  REQUIRE(
      WaitUntil([&] { return ReadLines(dir.path(), "pid.").size() == static_cast<size_t>(count); },
                absl::Seconds(30)));
  for (const std::string& line : ReadLines(dir.path(), "pid.")) {
    int pid = 0;
    REQUIRE(absl::SimpleAtoi(line, &pid));
    pids.push_back(pid);
  }
  return pids;
}

TEST_CASE("signals to the agent reach every worker, and nothing outlives it") {
  TempDir dir;
  SECTION("SIGINT: forwarded, SIGKILL after the shutdown timeout, exit 128+2") {
    // Rank 1 ignores SIGINT, so only the escalation stops it. (SIGTERM is
    // a preemption: launch_preemption_test.cc.)
    Child agent =
        StartLaunch(Concat({"--standalone", "--nproc_per_node=2", "--shutdown_timeout=0.5"},
                           ShellWorker("echo $$ > " + dir.path() +
                                       "/pid.$RANK; "
                                       "[ $RANK = 1 ] && trap '' INT; exec sleep 60")),
                    dir.File("agent.log"));
    std::vector<int> workers = Pids(dir, 2);
    absl::Time sent = absl::Now();
    kill(agent.pid(), SIGINT);
    CHECK(ExitCodeWithin(agent, absl::Seconds(20)) == 128 + SIGINT);
    CHECK(absl::Now() - sent < absl::Seconds(10));
    for (int pid : workers) CHECK(ProcessGone(pid));
  }
  SECTION("SIGKILL: the workers die with their agent") {
    Child agent =
        StartLaunch(Concat({"--standalone", "--nproc_per_node=2"},
                           ShellWorker("echo $$ > " + dir.path() + "/pid.$RANK; exec sleep 60")),
                    dir.File("agent.log"));
    std::vector<int> workers = Pids(dir, 2);
    kill(agent.pid(), SIGKILL);
    agent.WaitFor(absl::Seconds(10));
    for (int pid : workers) {
      CHECK(WaitUntil([&] { return ProcessGone(pid); }, absl::Seconds(10)));
    }
  }
}

// Workers that record "<round> <world size>" and run until told to stop.
std::string ElasticWorker(const TempDir& dir) {
  return "echo $MUSTER_ROUND $WORLD_SIZE >> " + dir.path() +
         "/rounds.$GROUP_RANK.$LOCAL_RANK.$$; "
         "echo $$ > " +
         dir.path() +
         "/pid.$RANK.$MUSTER_ROUND; "
         "while [ ! -e " +
         dir.path() + "/stop ]; do sleep 0.05; done";
}

// How many workers have reported running in a world of `world` workers.
size_t WorkersInWorld(const TempDir& dir, int world) {
  size_t count = 0;
  for (const std::string& line : ReadLines(dir.path(), "rounds.")) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() == 2 && fields[1] == absl::StrCat(world)) ++count;
  }
  return count;
}

TEST_CASE("elastic membership: nodes join and leave a running job") {
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> args = {"--nnodes=2:3",
                                   "--nproc_per_node=2",
                                   "--rdzv_endpoint",
                                   server->endpoint(),
                                   "--rdzv_id=elastic",
                                   "--max_restarts=3",
                                   "--rdzv_conf=last_call_timeout=0.3,lease_ttl=1",
                                   "--shutdown_timeout=2"};
  std::vector<std::string> command = Concat(args, ShellWorker(ElasticWorker(dir)));
  Child a = StartLaunch(command, dir.File("a.log"));
  Child b = StartLaunch(command, dir.File("b.log"));
  REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 4) == 4; }, absl::Seconds(30)));

  SECTION("scale-up: a third agent joins and everyone restarts into 3 nodes") {
    Child c = StartLaunch(command, dir.File("c.log"));
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 6) == 6; }, absl::Seconds(30)));
    WriteFile(dir.File("stop"), "");
    CHECK(ExitCodeWithin(a, absl::Seconds(30)) == 0);
    CHECK(ExitCodeWithin(b, absl::Seconds(30)) == 0);
    CHECK(ExitCodeWithin(c, absl::Seconds(30)) == 0);
  }
  SECTION("scale-down: SIGKILL one of 3 agents; the other 2 run again within ttl + 2 s") {
    Child c = StartLaunch(command, dir.File("c.log"));
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 6) == 6; }, absl::Seconds(30)));
    absl::Time killed = absl::Now();
    kill(c.pid(), SIGKILL);
    c.WaitFor(absl::Seconds(10));
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 4) == 8; }, absl::Seconds(10)));
    absl::Duration recovery = absl::Now() - killed;
    INFO("recovered in " << absl::FormatDuration(recovery));
    CHECK(recovery < absl::Seconds(3));  // lease ttl 1 s + 2 s
    WriteFile(dir.File("stop"), "");
    CHECK(ExitCodeWithin(a, absl::Seconds(30)) == 0);
    CHECK(ExitCodeWithin(b, absl::Seconds(30)) == 0);
  }
  SECTION("an agent paused past its lease joins again as a new node, and the job grows back") {
    // A VM paused, or a network cut, for longer than the lease: the job
    // goes on without the node, and the node comes back as a new one
    // rather than exiting 1 while the job has room for it.
    Child c = StartLaunch(command, dir.File("c.log"));
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 6) == 6; }, absl::Seconds(30)));
    REQUIRE(kill(c.pid(), SIGSTOP) == 0);
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 4) == 8; }, absl::Seconds(15)));
    REQUIRE(kill(c.pid(), SIGCONT) == 0);
    REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 6) == 12; }, absl::Seconds(30)));
    CHECK(absl::StrContains(ReadFile(dir.File("c.log")), "again as a new node"));
    WriteFile(dir.File("stop"), "");
    CHECK(ExitCodeWithin(a, absl::Seconds(30)) == 0);
    CHECK(ExitCodeWithin(b, absl::Seconds(30)) == 0);
    CHECK(ExitCodeWithin(c, absl::Seconds(30)) == 0);
  }
}

TEST_CASE("world_size_multiple: rounds take only fitting worlds; a spare that cannot fit waits") {
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> command =
      Concat({"--nnodes=1:4", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
              "--rdzv_id=multiple", "--rdzv_conf=last_call_timeout=0.3,world_size_multiple=2",
              "--shutdown_timeout=2"},
             ShellWorker(ElasticWorker(dir)));
  auto logged = [&](const std::string& log, const std::string& text) {
    return WaitUntil([&] { return absl::StrContains(ReadFile(dir.File(log)), text); },
                     absl::Seconds(20));
  };
  Child a = StartLaunch(command, dir.File("a.log"));
  // One node is --nnodes's minimum, but a world of 1 is not a multiple of 2.
  REQUIRE(logged("a.log", "waiting for round 0"));
  Child b = StartLaunch(command, dir.File("b.log"));
  REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 2) == 2; }, absl::Seconds(30)));
  // A third node cannot make a fitting world: it waits for round 1, and
  // the running nodes do not restart for it (before, they would have,
  // round after round, each new round leaving it out again).
  Child c = StartLaunch(command, dir.File("c.log"));
  REQUIRE(logged("c.log", "waiting for round 1"));
  CHECK(logged("c.log",
               "is running round 0 without this node (2 node(s), world 2): waiting as a "
               "spare"));
  // A fourth one makes 4: everyone restarts into round 1, the first restart.
  Child d = StartLaunch(command, dir.File("d.log"));
  REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 4) == 4; }, absl::Seconds(30)));
  for (const std::string& line : ReadLines(dir.path(), "rounds.")) {
    INFO(line);
    CHECK((line == "0 2" || line == "1 4"));
  }
  CHECK(ReadFile(dir.File("a.log")).find("nodes beyond the largest such world wait as spares") !=
        std::string::npos);
  WriteFile(dir.File("stop"), "");
  for (Child* agent : {&a, &b, &c, &d}) CHECK(ExitCodeWithin(*agent, absl::Seconds(30)) == 0);
}

TEST_CASE("a spare waits past join_timeout while the job runs, and exits 0 when it succeeds") {
  // join_timeout bounds how long a round may take to gather, on the
  // service. A spare of a running job is not gathering: it used to give up
  // after twice its own join_timeout (exit 1, DEADLINE_EXCEEDED), 20
  // minutes with the defaults, so a job lost its spares.
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> command =
      Concat({"--nnodes=1:1", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
              "--rdzv_id=spare", "--rdzv_conf=last_call_timeout=0.1,join_timeout=1",
              "--shutdown_timeout=2"},
             ShellWorker(ElasticWorker(dir)));
  Child a = StartLaunch(command, dir.File("a.log"));
  REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 1) == 1; }, absl::Seconds(20)));
  Child spare = StartLaunch(command, dir.File("spare.log"));
  auto times_logged = [&](const std::string& text) {
    std::string log = ReadFile(dir.File("spare.log"));
    size_t count = 0;
    for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++count;
    return count;
  };
  // Three of its own join_timeouts pass, the service still answering.
  REQUIRE(WaitUntil([&] { return times_logged("still waiting for a round of job spare") >= 3; },
                    absl::Seconds(30)));
  CHECK(times_logged("waiting as a spare") == 1);
  CHECK(!spare.WaitFor(absl::ZeroDuration()).has_value());
  WriteFile(dir.File("stop"), "");
  CHECK(ExitCodeWithin(a, absl::Seconds(30)) == 0);
  CHECK(ExitCodeWithin(spare, absl::Seconds(30)) == 0);
  std::string log = ReadFile(dir.File("spare.log"));
  CHECK(absl::StrContains(log, "this node waited as a spare and ran no worker"));
  CHECK(absl::StrContains(log, "job spare succeeded"));
}

TEST_CASE("a restart that cannot gather min_nodes fails with the service's reason on every node") {
  // Some agents used to print their own DEADLINE_EXCEEDED instead, as
  // their wait ran out at about the moment the service failed the job.
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> command = Concat(
      {"--nnodes=2:3", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
       "--rdzv_id=short", "--max_restarts=3",
       "--rdzv_conf=last_call_timeout=0.1,lease_ttl=1,join_timeout=2", "--shutdown_timeout=2"},
      ShellWorker(ElasticWorker(dir)));
  Child a = StartLaunch(command, dir.File("a.log"));
  Child b = StartLaunch(command, dir.File("b.log"));
  REQUIRE(WaitUntil([&] { return WorkersInWorld(dir, 2) == 2; }, absl::Seconds(20)));
  kill(b.pid(), SIGKILL);
  b.WaitFor(absl::Seconds(10));
  CHECK(ExitCodeWithin(a, absl::Seconds(30)) == 1);
  std::string log = ReadFile(dir.File("a.log"));
  INFO(log);
  CHECK(absl::StrContains(log, "job short failed: join timeout: only 1 of min_nodes 2"));
  CHECK(!absl::StrContains(log, "DEADLINE_EXCEEDED"));
  WriteFile(dir.File("stop"), "");
}

TEST_CASE("a failed job is reported in launch's own TORCHELASTIC_ERROR_FILE, as torchrun does") {
  // Schedulers that run torchrun (TorchX and others) set the variable and
  // read why the job failed from it.
  TempDir dir;
  const std::string parent = dir.File("parent.json");
  Child failed = StartLaunch(
      Concat({"--standalone", "--nproc_per_node=2"},
             ShellWorker("[ $RANK = 1 ] || exec sleep 30; printf '{\"message\": \"ValueError: "
                         "boom\"}' > $TORCHELASTIC_ERROR_FILE; exit 3")),
      dir.File("failed.log"), {"TORCHELASTIC_ERROR_FILE=" + parent});
  CHECK(ExitCodeWithin(failed, absl::Seconds(30)) == 3);
  CHECK(ReadFile(parent) == "{\"message\": \"ValueError: boom\"}");
  // No error file from the worker: the failure in torch's shape.
  Child bare = StartLaunch(Concat({"--standalone"}, ShellWorker("exit 4")), dir.File("bare.log"),
                           {"TORCHELASTIC_ERROR_FILE=" + parent});
  CHECK(ExitCodeWithin(bare, absl::Seconds(30)) == 4);
  CHECK(absl::StartsWith(ReadFile(parent), "{\"message\": {\"message\": \"rank 0 on "));
  CHECK(absl::StrContains(ReadFile(parent), "failed (exit code 4)"));
  // A job that succeeds writes nothing there.
  std::remove(parent.c_str());
  Child fine = StartLaunch(Concat({"--standalone"}, ShellWorker("true")), dir.File("fine.log"),
                           {"TORCHELASTIC_ERROR_FILE=" + parent});
  CHECK(ExitCodeWithin(fine, absl::Seconds(30)) == 0);
  CHECK(!std::filesystem::exists(parent));
}

TEST_CASE("what a worker leaves running ends with it, and the agent says so") {
  TempDir dir;
  Child agent = StartLaunch(
      Concat({"--standalone"}, ShellWorker("sleep 60 & echo $! > " + dir.File("bg.pid"))),
      dir.File("agent.log"));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  const std::string pid = std::string(absl::StripAsciiWhitespace(ReadFile(dir.File("bg.pid"))));
  CHECK_THAT(ReadFile(dir.File("agent.log")),
             Catch::Contains("rank 0 ended with 1 process(es) of its own still running (pid " +
                             pid + ")"));
  CHECK(!std::filesystem::exists("/proc/" + pid + "/stat"));
}

TEST_CASE("an unmodified PyTorch gloo DDP script runs under 2 agents x 2 workers") {
  // Debian's python3-torch lives under /usr/bin/python3 (scripts/test.sh
  // installs it); the pyenv python3 on PATH has no torch.
  REQUIRE(system("/usr/bin/python3 -c 'import torch.distributed' 2>/dev/null") == 0);
  TempDir dir;
  auto server = StartServer();
  std::vector<std::string> args = {
      "--nnodes=2",       "--nproc_per_node=2", "--rdzv_endpoint",
      server->endpoint(), "--rdzv_id=torchjob", RunfilePath("tests/launcher/ddp_allreduce.py"),
      dir.path()};
  std::vector<std::string> env = {"PYTHON_EXEC=/usr/bin/python3"};
  Child first = StartLaunch(args, dir.File("agent0.log"), env);
  Child second = StartLaunch(args, dir.File("agent1.log"), env);
  int first_code = ExitCodeWithin(first, absl::Seconds(120));
  int second_code = ExitCodeWithin(second, absl::Seconds(120));
  INFO(ReadFile(dir.File("agent0.log")) << ReadFile(dir.File("agent1.log")));
  CHECK(first_code == 0);
  CHECK(second_code == 0);
  std::set<std::string> gradients;
  for (int rank = 0; rank < 4; ++rank) {
    std::vector<std::string> fields =
        absl::StrSplit(ReadFile(dir.File(absl::StrCat("result.", rank))), ' ');
    REQUIRE(fields.size() == 4);
    CHECK(fields[0] == "4");     // world size
    CHECK(fields[1] == "10.0");  // 1 + 2 + 3 + 4: every rank took part
    gradients.insert(fields[2]);
  }
  CHECK(gradients.size() == 1);  // DDP averaged the gradients across ranks
}

TEST_CASE("static backend: node 0 hosts the rendezvous, node ranks are kept") {
  TempDir dir;
  absl::StatusOr<int> port = launcher::PickFreePort();
  REQUIRE(port.ok());
  std::string script = "echo $GROUP_RANK $RANK > " + dir.path() + "/static.$RANK";
  std::vector<Child> agents;
  // Node 1 starts first: it waits (with backoff) for node 0's server.
  for (int node_rank : {1, 0}) {
    agents.push_back(
        StartLaunch(Concat({"--rdzv_backend=static", "--nnodes=2", "--nproc_per_node=2",
                            absl::StrCat("--node_rank=", node_rank), "--master_addr=127.0.0.1",
                            absl::StrCat("--master_port=", *port), "--rdzv_conf=join_timeout=30"},
                           ShellWorker(script)),
                    dir.File(absl::StrCat("node", node_rank, ".log"))));
  }
  for (Child& agent : agents) CHECK(ExitCodeWithin(agent, absl::Seconds(60)) == 0);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(ReadFile(dir.File(absl::StrCat("static.", rank))) ==
          absl::StrCat(rank / 2, " ", rank, "\n"));
  }
}

TEST_CASE("no rendezvous flags: one node runs as torchrun's static default does") {
  TempDir dir;
  absl::StatusOr<int> port = launcher::PickFreePort();
  REQUIRE(port.ok());
  // torchrun --nproc_per_node=2 train.py: node 0 of 1 hosts the rendezvous
  // at 127.0.0.1:master_port (its default 29500; a free one here, so that
  // tests running at once do not collide).
  Child agent = StartLaunch(
      Concat({"--nproc_per_node=2", absl::StrCat("--master_port=", *port)},
             ShellWorker("echo $GROUP_RANK $RANK $WORLD_SIZE > " + dir.path() + "/default.$RANK")),
      dir.File("agent.log"));
  INFO(ReadFile(dir.File("agent.log")));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(ReadFile(dir.File(absl::StrCat("default.", rank))) == absl::StrCat("0 ", rank, " 2\n"));
  }
}

TEST_CASE("c10d backend: the agent on the endpoint's machine hosts the rendezvous") {
  TempDir dir;
  absl::StatusOr<int> port = launcher::PickFreePort();
  REQUIRE(port.ok());
  // Two agents on this machine, as torchrun's c10d examples run one per
  // node: whichever binds the port first hosts the service, the other
  // finds it taken and joins as a client.
  std::string script = "echo $GROUP_RANK $RANK $WORLD_SIZE > " + dir.path() + "/c10d.$RANK";
  std::vector<Child> agents;
  for (int agent = 0; agent < 2; ++agent) {
    agents.push_back(
        StartLaunch(Concat({"--rdzv_backend=c10d",
                            absl::StrCat("--rdzv_endpoint=127.0.0.1:", *port), "--rdzv_id=c10d-job",
                            "--nnodes=2", "--nproc_per_node=2", "--rdzv_conf=join_timeout=30"},
                           ShellWorker(script)),
                    dir.File(absl::StrCat("agent", agent, ".log"))));
  }
  int hosts = 0;
  for (int agent = 0; agent < 2; ++agent) {
    CHECK(ExitCodeWithin(agents[agent], absl::Seconds(60)) == 0);
    const std::string log = ReadFile(dir.File(absl::StrCat("agent", agent, ".log")));
    INFO(log);
    if (log.find("this agent hosts the rendezvous") != std::string::npos) ++hosts;
  }
  CHECK(hosts == 1);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(ReadFile(dir.File(absl::StrCat("c10d.", rank))) ==
          absl::StrCat(rank / 2, " ", rank, " 4\n"));
  }

  // torchrun's single-node form: port 0 picks a free port.
  Child single = StartLaunch(
      Concat({"--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nproc-per-node=2"},
             ShellWorker("echo $RANK > " + dir.path() + "/single.$RANK")),
      dir.File("single.log"));
  INFO(ReadFile(dir.File("single.log")));
  CHECK(ExitCodeWithin(single, absl::Seconds(30)) == 0);
  CHECK(ReadFile(dir.File("single.1")) == "1\n");
}

TEST_CASE("the agent logs on stderr: stdout carries only what the workers print") {
  // As torchrun, whose agent logs through Python's logging (stderr): a
  // job's stdout can be piped into a program that reads the workers' lines.
  TempDir dir;
  Child agent = StartLaunch(Concat({"--standalone", "--nproc_per_node=1", "--rdzv_id=streams"},
                                   ShellWorker("echo out-line; echo err-line >&2")),
                            dir.File("stdout"), {}, dir.File("stderr"));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  const std::string stdout_text = ReadFile(dir.File("stdout"));
  CHECK(absl::EndsWith(stdout_text, "rank0]: out-line\n"));  // the console's rank prefix
  CHECK(stdout_text.find('\n') == stdout_text.size() - 1);   // and no other line
  const std::string stderr_text = ReadFile(dir.File("stderr"));
  CHECK(stderr_text.find("err-line") != std::string::npos);
  CHECK(stderr_text.find("[launch ") != std::string::npos);
}

// As a user at a shell runs it, launch in the foreground of a terminal: a
// worker can read that terminal (input(), pdb at rank 0), as under torchrun.
// In a process group of its own it was stopped by SIGTTIN on its first read,
// and the job hung without a word.
TEST_CASE("a worker reads the terminal that launch runs at") {
  std::vector<std::string> args = {BinaryPath("launcher/launch"),
                                   "--standalone",
                                   "--nproc_per_node=1",
                                   "--rdzv_id=tty",
                                   "--no_python",
                                   "/bin/sh",
                                   "-c",
                                   "read line; echo got:$line"};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  int terminal = -1;
  const pid_t pid = forkpty(&terminal, nullptr, nullptr, nullptr);
  REQUIRE(pid >= 0);
  if (pid == 0) {  // a session of its own, the terminal's foreground
    execv(argv[0], argv.data());
    _exit(127);
  }
  // Typed at once: the terminal holds the line until the worker reads it.
  REQUIRE(write(terminal, "hello\n", 6) == 6);
  std::string shown;
  int status = 0;
  bool exited = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!exited && absl::Now() < deadline) {
    pollfd readable{terminal, POLLIN, 0};
    if (poll(&readable, 1, 50) > 0) {
      char buffer[4096];
      const ssize_t got = read(terminal, buffer, sizeof(buffer));
      if (got > 0) shown.append(buffer, static_cast<size_t>(got));
    }
    exited = waitpid(pid, &status, WNOHANG) == pid;
  }
  if (!exited) {
    kill(pid, SIGKILL);  // its worker follows (PR_SET_PDEATHSIG)
    waitpid(pid, &status, 0);
  }
  close(terminal);
  INFO(shown);
  REQUIRE(exited);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(shown.find("got:hello") != std::string::npos);
}

TEST_CASE("--local_ranks_filter limits the console, not the log files") {
  TempDir dir;
  Child agent = StartLaunch(Concat({"--standalone", "--nproc_per_node=2", "--local_ranks_filter=1",
                                    "--tee=1", "--log_dir", dir.File("logs"), "--rdzv_id=filtered"},
                                   ShellWorker("echo line from $RANK")),
                            dir.File("agent.log"));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  std::string console = ReadFile(dir.File("agent.log"));
  CHECK(console.find("rank1]: line from 1") != std::string::npos);
  CHECK(console.find("line from 0") == std::string::npos);
  CHECK(ReadFile(dir.File("logs") + "/filtered/attempt_0/0/stdout.log") == "line from 0\n");
}

TEST_CASE("without --log_dir, the run's directory in $TMPDIR keeps only what holds a file") {
  TempDir dir;
  const std::string tmp = dir.File("tmp");
  std::filesystem::create_directories(tmp);
  auto runs_left = [&tmp] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(tmp)) {
      names.push_back(entry.path().filename().string());
    }
    return names;
  };
  // Nothing redirected and no failure: every rank's directory is empty.
  Child quiet = StartLaunch(Concat({"--standalone", "--nproc_per_node=2", "--rdzv_id=quiet"},
                                   ShellWorker("echo hi from $RANK")),
                            dir.File("quiet.log"), {"TMPDIR=" + tmp});
  INFO(ReadFile(dir.File("quiet.log")));
  CHECK(ExitCodeWithin(quiet, absl::Seconds(30)) == 0);
  CHECK(runs_left().empty());

  // Rank 1's stdout went to a file: that file, and its directories, stay.
  Child redirected = StartLaunch(
      Concat({"--standalone", "--nproc_per_node=2", "--rdzv_id=kept", "--redirects", "1:1"},
             ShellWorker("echo hi from $RANK")),
      dir.File("kept.log"), {"TMPDIR=" + tmp});
  INFO(ReadFile(dir.File("kept.log")));
  CHECK(ExitCodeWithin(redirected, absl::Seconds(30)) == 0);
  const std::vector<std::string> left = runs_left();
  REQUIRE(left.size() == 1);
  CHECK(left[0].rfind("muster_kept_", 0) == 0);
  const std::string run = tmp + "/" + left[0];
  CHECK(ReadFile(run + "/attempt_0/1/stdout.log") == "hi from 1\n");
  CHECK_FALSE(std::filesystem::exists(run + "/attempt_0/0"));
  // And the agent says where, at its end.
  CHECK(absl::StrContains(ReadFile(dir.File("kept.log")), "this run's logs are kept in " + run));
}

// torchrun makes a fresh directory in --log_dir for every run; here a rerun
// with the same run id goes on counting attempts, so it neither appends to
// an earlier run's files nor overwrites them.
TEST_CASE("a rerun with the same --log_dir and run id leaves the earlier run's logs as they were") {
  TempDir dir;
  auto run = [&](const std::string& name) {
    Child agent = StartLaunch(Concat({"--standalone", "--nproc_per_node=1", "--rdzv_id=again",
                                      "--log_dir", dir.File("logs"), "--redirects=1"},
                                     ShellWorker("echo " + name)),
                              dir.File(name + ".log"));
    CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  };
  run("first");
  run("second");
  CHECK(ReadFile(dir.File("logs") + "/again/attempt_0/0/stdout.log") == "first\n");
  CHECK(ReadFile(dir.File("logs") + "/again/attempt_1/0/stdout.log") == "second\n");
}

TEST_CASE("a job runs on while the rendezvous token is rotated, with no restart of anything") {
  TempDir dir;
  // The server's tokens, and the one the agent (and its workers) present.
  const std::string server_tokens = dir.File("server_tokens"), token = dir.File("token");
  // WriteFile renames a new file into place, as tools that rotate secrets do.
  auto replace = WriteFile;
  replace(server_tokens, "old-token\n");
  replace(token, "old-token\n");
  auto server = StartServer(
      {"--token-file", server_tokens, "--credentials-refresh", "0.05", "--log-level", "info"});
  // The worker runs until the test writes to its fifo.
  REQUIRE(mkfifo(dir.File("go").c_str(), 0600) == 0);
  Child agent =
      StartLaunch(Concat({"--nnodes=1", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
                          "--rdzv_id=rotated", "--rdzv_conf=token_file=" + token},
                         ShellWorker("touch " + dir.File("started") + "; read line < " +
                                     dir.File("go") + "; echo worker saw $line")),
                  dir.File("agent.log"));
  REQUIRE(
      WaitUntil([&] { return access(dir.File("started").c_str(), F_OK) == 0; }, absl::Seconds(30)));

  // The rotation of docs/rendezvous.md: the server accepts both, the
  // clients' file gets the new token, the server drops the old one. Each
  // server step is awaited in its log.
  replace(server_tokens, "old-token\nnew-token\n");
  const bool both = WaitUntil(
      [&] { return absl::StrContains(server->output(), "2 token(s) accepted now, 1 before"); },
      absl::Seconds(10));
  INFO(server->output() << ReadFile(dir.File("agent.log")));
  REQUIRE(both);
  replace(token, "new-token\n");
  replace(server_tokens, "new-token\n");
  REQUIRE(WaitUntil(
      [&] { return absl::StrContains(server->output(), "1 token(s) accepted now, 2 before"); },
      absl::Seconds(10)));

  // The worker finishes; the agent reports it done with the new token.
  std::ofstream(dir.File("go")) << "go\n";  // into the fifo, not over it
  const int code = ExitCodeWithin(agent, absl::Seconds(30));
  const std::string log = ReadFile(dir.File("agent.log"));
  INFO(log << server->output());
  CHECK(code == 0);
  CHECK(absl::StrContains(log, "worker saw go"));
  CHECK(absl::StrContains(server->output(), "job rotated: finished SUCCEEDED"));
  CHECK_FALSE(absl::StrContains(log, "UNAUTHENTICATED"));
  CHECK_FALSE(absl::StrContains(log, "round 1"));
}

TEST_CASE("a log file that cannot be written is given up with a warning, not the output") {
  TempDir dir;
  // rank 0's stdout.log leads to /dev/full, where every write fails with
  // ENOSPC as on a full disk; its stderr.log is an ordinary file.
  const std::string attempt = dir.File("logs") + "/fulllog/attempt_0/0";
  std::filesystem::create_directories(attempt);
  REQUIRE(symlink("/dev/full", (attempt + "/stdout.log").c_str()) == 0);
  Child agent = StartLaunch(Concat({"--standalone", "--nproc_per_node=1", "--redirects=3",
                                    "--log_dir", dir.File("logs"), "--rdzv_id=fulllog"},
                                   ShellWorker("echo hello; echo oops >&2; exit 3")),
                            dir.File("agent.log"));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 3);
  const std::string console = ReadFile(dir.File("agent.log"));
  INFO(console);
  // Redirected, stdout would be in its file only: the console shows it
  // instead of losing it, after one warning.
  CHECK(absl::StrContains(console, "cannot write the log file " + attempt +
                                       "/stdout.log: No space left on device; its output goes "
                                       "to the console instead"));
  CHECK(absl::StrContains(console, "rank0]: hello"));
  // stderr went to its file, as asked, and the failure table points there.
  CHECK_FALSE(absl::StrContains(console, "oops"));
  CHECK(ReadFile(attempt + "/stderr.log") == "oops\n");
  CHECK(
      absl::StrContains(console, "(no error file; see its stderr in " + attempt + "/stderr.log)"));
}

TEST_CASE("a log directory that cannot be made costs the rank its log files, not the job") {
  TempDir dir;
  // Something where rank 0's directory would go: mkdir fails, as on a full
  // disk. A FIFO, not a file: a file would make attempt_0 an earlier run's.
  std::filesystem::create_directories(dir.File("logs") + "/nodir/attempt_0");
  REQUIRE(mkfifo((dir.File("logs") + "/nodir/attempt_0/0").c_str(), 0600) == 0);
  Child agent = StartLaunch(Concat({"--standalone", "--nproc_per_node=1", "--redirects=1",
                                    "--log_dir", dir.File("logs"), "--rdzv_id=nodir"},
                                   ShellWorker("echo hello; exit 3")),
                            dir.File("agent.log"));
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 3);  // the worker ran, and failed on its own
  const std::string console = ReadFile(dir.File("agent.log"));
  INFO(console);
  CHECK(
      absl::StrContains(console, "cannot create the log directory " + dir.File("logs") +
                                     "/nodir/attempt_0/0: Not a directory; rank 0 runs without its "
                                     "error file and log files"));
  CHECK(absl::StrContains(console, "its output goes to the console instead"));
  CHECK(absl::StrContains(console, "rank0]: hello"));
  CHECK(absl::StrContains(console, "(no error file; see the worker's stderr)"));
}

// A process's peak resident set (VmHWM) in MiB, or -1 once it is gone.
int64_t PeakRssMib(int pid) {
  std::string status = ReadFile(absl::StrCat("/proc/", pid, "/status"));
  size_t at = status.find("VmHWM:");
  int64_t kib = 0;
  if (at == std::string::npos || !absl::SimpleAtoi(absl::StripAsciiWhitespace(status.substr(
                                                       at + 6, status.find(" kB", at) - at - 6)),
                                                   &kib)) {
    return -1;
  }
  return kib / 1024;
}

TEST_CASE("a progress bar without newlines does not grow the agent") {
  // tqdm redraws with '\r' and no '\n': 43 MB of it once took the agent's
  // peak RSS from about 20 MB to 105 MB.
  TempDir dir;
  std::string script =
      "awk 'BEGIN { for (i = 0; i < 1000000; i++) "
      "printf \"\\r%3d%%|#####     | %7d/1000000 [00:12<00:09]\", i % 100, i }'; "
      "echo > " +
      dir.path() +
      "/printed; "
      "while [ ! -e " +
      dir.path() + "/stop ]; do sleep 0.05; done";
  Child agent = StartLaunch(Concat({"--standalone"}, ShellWorker(script)), dir.File("agent.log"));
  REQUIRE(WaitUntil([&] { return !ReadFile(dir.File("printed")).empty(); }, absl::Seconds(60)));
  absl::SleepFor(absl::Milliseconds(500));  // the pump's last reads
  int64_t peak_mib = PeakRssMib(agent.pid());
  WriteFile(dir.File("stop"), "");
  CHECK(ExitCodeWithin(agent, absl::Seconds(30)) == 0);
  int64_t console_mib = static_cast<int64_t>(ReadFile(dir.File("agent.log")).size()) >> 20;
  WARN("agent peak RSS " << peak_mib << " MiB after " << console_mib << " MiB of console");
  CHECK(console_mib >= 43);  // it all reached the console
  CHECK(peak_mib > 0);
  CHECK(peak_mib < 48);
}

TEST_CASE("bad command lines and unreachable services fail fast with exit 2") {
  TempDir dir;
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"--nnodes", "3:2", "--standalone", "x.yaml"}, "--nnodes 3:2"},
      {{"--rdzv_backend", "etcd", "--rdzv_endpoint", "h", "x.yaml"}, "--rdzv_backend etcd"},
      {{"--standalone"}, "missing target"},
      {{"--standalone", "missing.py"}, "missing.py"},
      {{"--rdzv_endpoint", "127.0.0.1:1", "--rdzv_conf", "join_timeout=1", "--no_python", "true"},
       "cannot use the rendezvous service at 127.0.0.1:1"},
  };
  // A layout no world of the --nnodes range can hold: refused before any
  // worker starts, naming the yaml's layout and the flags.
  WriteFile(dir.File("pp2.yaml"),
            "data:\n  train: none_*.bin\n  grad_accumulation: 2\nparallel:\n  pp: 2\n");
  cases.push_back({{"--standalone", "--nproc_per_node=3", dir.File("pp2.yaml")},
                   "pp2.yaml's parallel layout (dp_replicate 0 x dp_shard 0 x pp 2, 0 is auto) "
                   "needs a world that is a multiple of 2, but with --nproc_per_node 3 no node "
                   "count of --standalone (one node) makes one; the node counts that do are the "
                   "multiples of 2"});
  // --standalone is one node, whatever --nnodes says.
  cases.push_back({{"--standalone", "--nnodes=1:2", dir.File("pp2.yaml")},
                   "no node count of --standalone (one node) makes one"});
  // No auto degree: the world is exactly dp_replicate x pp, not a multiple.
  WriteFile(dir.File("fixed.yaml"),
            "data:\n  train: none_*.bin\n  grad_accumulation: 2\nparallel:\n  pp: 2\n"
            "  dp_replicate: 1\n");
  cases.push_back({{"--rdzv_endpoint", "127.0.0.1:1", "--nnodes=3:4", dir.File("fixed.yaml")},
                   "fixed.yaml's parallel layout (dp_replicate 1 x dp_shard 0 x pp 2, 0 is auto) "
                   "fixes the world at 2 ranks, which --nnodes 3:4 at --nproc_per_node 1 cannot "
                   "make (it takes 2 nodes)"});
  cases.push_back({{"--standalone", "--rdzv_conf=world_size_multiple=3", "--nproc_per_node=2",
                    dir.File("pp2.yaml")},
                   "--rdzv_conf world_size_multiple=3 would allow worlds that"});
  cases.push_back({{"--standalone", "--rdzv_conf=world_size_multiple=0", "--no_python", "true"},
                   "world_size_multiple=0: expected an integer >= 1"});
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].message);
    std::string log = dir.File(absl::StrCat("case", i, ".log"));
    Child agent = StartLaunch(cases[i].args, log);
    CHECK(ExitCodeWithin(agent, absl::Seconds(20)) == 2);
    CHECK(ReadFile(log).find(cases[i].message) != std::string::npos);
  }
  // One worker per GPU with no GPU: refused, naming why (no GPU here, and
  // none visible on any machine with CUDA_VISIBLE_DEVICES empty).
  std::string log = dir.File("gpu.log");
  Child agent = StartLaunch({"--standalone", "--nproc_per_node", "gpu", "--no_python", "true"}, log,
                            {"CUDA_VISIBLE_DEVICES="});
  CHECK(ExitCodeWithin(agent, absl::Seconds(20)) == 2);
  CHECK_THAT(ReadFile(log), Catch::Contains("--nproc_per_node gpu: no CUDA device is visible"));
}

}  // namespace
}  // namespace muster::testing
