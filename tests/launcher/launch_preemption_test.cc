// Preemption as a scheduler does it: SIGTERM (or a SIGUSR1 launch was told
// to handle) to the agent, a grace period, then SIGKILL. Workers that save
// their state exit kPreemptedExitCode; launch reports "preempted" and exits
// with that code so a wrapper can requeue the job.
#include <signal.h>

#include <catch2/catch.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/worker_env.h"
#include "tests/launcher/harness.h"

namespace muster::testing {
namespace {

using launcher::Child;
using launcher::kPreemptedExitCode;

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A worker that records its pid and the grace it was given, then on
// `signal` writes a marker (its "checkpoint") and exits 75. With
// `stubborn_rank` >= 0, that rank ignores the signal instead.
std::vector<std::string> PreemptibleWorker(const TempDir& dir, const std::string& signal,
                                           int stubborn_rank = -1) {
  std::string script = "trap 'echo saved > " + dir.path() + "/marker.$RANK; exit " +
                       absl::StrCat(kPreemptedExitCode) + "' " + signal + "; " +
                       "[ $RANK = " + absl::StrCat(stubborn_rank) + " ] && trap '' " + signal +
                       "; " + "echo $MUSTER_PREEMPT_GRACE_S > " + dir.path() + "/grace.$RANK; " +
                       "echo $$ > " + dir.path() + "/pid.$RANK; " + "while :; do sleep 0.05; done";
  return {"--no_python", "/bin/sh", "-c", script};
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

struct Stopped {
  int code;
  absl::Duration took;
  std::string log;
};

Stopped SignalAndWait(Child& agent, int signal_number, const std::string& log) {
  absl::SleepFor(absl::Milliseconds(200));  // the traps are set before the pid is written
  absl::Time sent = absl::Now();
  REQUIRE(kill(agent.pid(), signal_number) == 0);
  auto exit = agent.WaitFor(absl::Seconds(30));
  absl::Duration took = absl::Now() - sent;
  INFO(ReadFile(log));
  REQUIRE(exit.has_value());
  return {exit->ShellCode(), took, ReadFile(log)};
}

TEST_CASE("SIGTERM preempts: workers save, exit 75, and launch exits 75") {
  TempDir dir;
  Child agent = StartLaunch(
      Concat({"--standalone", "--nproc_per_node=2", "--preempt_grace=5", "--max_restarts=3"},
             PreemptibleWorker(dir, "TERM")),
      dir.File("agent.log"));
  std::vector<int> workers = Pids(dir, 2);
  Stopped stopped = SignalAndWait(agent, SIGTERM, dir.File("agent.log"));
  INFO(stopped.log);
  CHECK(stopped.code == kPreemptedExitCode);
  WARN("preempted in " << absl::FormatDuration(stopped.took));
  CHECK(stopped.took < absl::Seconds(5));
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(ReadFile(dir.File(absl::StrCat("marker.", rank))) == "saved\n");
    CHECK(ReadFile(dir.File(absl::StrCat("grace.", rank))) == "5\n");
  }
  CHECK_THAT(stopped.log, Catch::Contains("preempted"));
  CHECK_THAT(stopped.log, !Catch::Contains("workers failed"));  // no failure table
  for (int pid : workers) CHECK(ProcessGone(pid));
}

TEST_CASE("a worker that ignores the preemption signal is SIGKILLed after the grace") {
  TempDir dir;
  // The grace, not the (much longer) shutdown timeout, bounds the wait.
  Child agent = StartLaunch(
      Concat({"--standalone", "--nproc_per_node=2", "--preempt_grace=1", "--shutdown_timeout=60"},
             PreemptibleWorker(dir, "TERM", /*stubborn_rank=*/1)),
      dir.File("agent.log"));
  std::vector<int> workers = Pids(dir, 2);
  Stopped stopped = SignalAndWait(agent, SIGTERM, dir.File("agent.log"));
  INFO(stopped.log);
  // Not every worker saved its state: not a clean preemption.
  CHECK(stopped.code == 128 + SIGTERM);
  CHECK(stopped.took >= absl::Seconds(1));
  CHECK(stopped.took < absl::Seconds(5));
  CHECK(ReadFile(dir.File("marker.0")) == "saved\n");
  CHECK_THAT(stopped.log, Catch::Contains("SIGKILL"));
  for (int pid : workers) CHECK(ProcessGone(pid));
}

TEST_CASE("SIGTERM as the workers finish: they exit 0, the job succeeds and launch exits 0") {
  // The worker saves its last step and exits 0 when the signal comes in
  // that step: the job is done, nothing is left to requeue.
  TempDir dir;
  auto server = StartServer();
  const std::vector<std::string> args = {"--nnodes=1", "--nproc_per_node=2", "--rdzv_endpoint",
                                         server->endpoint(), "--rdzv_id=finishing"};
  std::string script =
      "trap 'exit 0' TERM; echo $$ > " + dir.path() + "/pid.$RANK; sleep 60 & wait";
  Child agent =
      StartLaunch(Concat(args, {"--no_python", "/bin/sh", "-c", script}), dir.File("agent.log"));
  Pids(dir, 2);
  Stopped stopped = SignalAndWait(agent, SIGTERM, dir.File("agent.log"));
  INFO(stopped.log);
  CHECK(stopped.code == 0);
  CHECK_THAT(stopped.log, Catch::Contains("this node's workers succeeded as SIGTERM came"));
  CHECK_THAT(stopped.log, !Catch::Contains("not clean"));
  // It reported them done, so the job closed as succeeded: a requeued
  // launch of it is told so.
  Child again = StartLaunch(Concat(args, {"--no_python", "/bin/true"}), dir.File("again.log"));
  auto exit = again.WaitFor(absl::Seconds(30));
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == 2);
  CHECK_THAT(ReadFile(dir.File("again.log")), Catch::Contains("is closed (succeeded at round 0)"));
}

TEST_CASE("SIGUSR1, when launch is told to handle it, preempts too") {
  TempDir dir;
  Child agent = StartLaunch(
      Concat({"--standalone", "--nproc_per_node=2", "--signals_to_handle=SIGTERM,SIGUSR1"},
             PreemptibleWorker(dir, "USR1")),
      dir.File("agent.log"));
  Pids(dir, 2);
  Stopped stopped = SignalAndWait(agent, SIGUSR1, dir.File("agent.log"));
  INFO(stopped.log);
  CHECK(stopped.code == kPreemptedExitCode);
  CHECK(ReadFile(dir.File("marker.0")) == "saved\n");
  CHECK(ReadFile(dir.File("marker.1")) == "saved\n");
  CHECK(ReadFile(dir.File("grace.0")) == "30\n");  // the default
}

TEST_CASE("a worker preempted directly (the scheduler signalled it) preempts its node") {
  // Schedulers signal every process of the job: a worker may exit 75 before
  // its agent reads its own SIGTERM. That is a preemption, not a failure to
  // restart from.
  TempDir dir;
  std::string script = "echo run >> " + dir.path() +
                       "/runs.$RANK; "
                       "trap 'echo saved > " +
                       dir.path() +
                       "/marker.$RANK; exit 75' TERM; "
                       "[ $RANK = 1 ] && echo > " +
                       dir.path() +
                       "/ready; "
                       "if [ $RANK = 0 ]; then while [ ! -e " +
                       dir.path() +
                       "/ready ]; do sleep 0.02; done; "
                       "exit 75; fi; while :; do sleep 0.05; done";
  Child agent = StartLaunch({"--standalone", "--nproc_per_node=2", "--max_restarts=3",
                             "--no_python", "/bin/sh", "-c", script},
                            dir.File("agent.log"));
  auto exit = agent.WaitFor(absl::Seconds(30));
  std::string log = ReadFile(dir.File("agent.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == kPreemptedExitCode);
  CHECK(ReadFile(dir.File("runs.0")) == "run\n");  // not restarted
  CHECK(ReadFile(dir.File("marker.1")) == "saved\n");
  CHECK_THAT(log, Catch::Contains("preempted"));
}

TEST_CASE("a worker's exit 75 that its peers do not follow is a failure, and the job restarts") {
  // A script that exits 75 (EX_TEMPFAIL) for its own reasons, its peer
  // dying of the SIGTERM that followed: the agent got no signal, yet it
  // reported "preemption (SIGTERM) not clean" and exited 143 with its
  // restart budget unused. torchrun restarts such a job.
  TempDir dir;
  std::string script = "echo run >> " + dir.path() + "/runs.$RANK; [ $RANK = 1 ] && exit 75; " +
                       "while :; do sleep 0.05; done";
  Child agent = StartLaunch({"--standalone", "--nproc_per_node=2", "--max_restarts=1",
                             "--no_python", "/bin/sh", "-c", script},
                            dir.File("agent.log"));
  auto exit = agent.WaitFor(absl::Seconds(30));
  std::string log = ReadFile(dir.File("agent.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == 1);  // failed, not "preempted" for a scheduler to requeue
  CHECK(ReadFile(dir.File("runs.0")) == "run\nrun\n");  // restarted once
  CHECK_THAT(log, Catch::Contains("taking rank 1's exit 75 as a failure"));
  CHECK_THAT(log, Catch::Contains("restart budget of 1 spent"));
  CHECK_THAT(log, !Catch::Contains("not clean"));
}

// One node of two preempted: every rank stops after the same step and
// saves it, so the other node's workers exit 75 on their own, maybe after
// the preempted node has left. Which the other agent heard of first, the
// round's end or its workers' exits, decided between rejoining (and
// waiting up to join_timeout for a node that was gone) and exiting 75.
TEST_CASE("one node preempted: the other node's workers save and exit 75, and so does its agent") {
  TempDir dir;
  auto server = StartServer();
  const std::string stopping = dir.File("stopping");
  // Node A's worker: on SIGTERM it "saves" at once and tells the other
  // node's to stop. Node B's then takes a second to save, and ignores
  // SIGTERM meanwhile, as muster's worker finishing a save does. Each writes
  // its pid once its trap is set.
  const std::string pid = "echo $$ > " + dir.File("pid.$RANK");
  const std::string node_a =
      "trap 'touch " + stopping + "; exit 75' TERM; " + pid + "; while :; do sleep 0.05; done";
  const std::string node_b = "trap '' TERM; " + pid + "; while [ ! -e " + stopping +
                             " ]; do sleep 0.05; done; sleep 1; exit 75";
  auto agent = [&](const std::string& name, const std::string& script) {
    return StartLaunch(
        {"--nnodes=2", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(),
         "--rdzv_id=partial", "--max_restarts=3", "--rdzv_conf=lease_ttl=60,join_timeout=60",
         "--no_python", "/bin/sh", "-c", script},
        dir.File("agent_" + name + ".log"));
  };
  Child a = agent("a", node_a);
  Child b = agent("b", node_b);
  Pids(dir, 2);
  REQUIRE(kill(a.pid(), SIGTERM) == 0);
  auto a_exit = a.WaitFor(absl::Seconds(30));
  REQUIRE(a_exit.has_value());
  CHECK(a_exit->ShellCode() == kPreemptedExitCode);
  auto b_exit = b.WaitFor(absl::Seconds(30));
  const std::string log = ReadFile(dir.File("agent_b.log"));
  INFO(log);
  REQUIRE(b_exit.has_value());
  CHECK(b_exit->ShellCode() == kPreemptedExitCode);
  CHECK_THAT(log, Catch::Contains("exited 75 (preempted)"));
}

}  // namespace
}  // namespace muster::testing
