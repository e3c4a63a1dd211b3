// A handled signal ends every wait of a real `launch` agent, not only the
// loop that watches its workers: gathering for a round, the MASTER_PORT
// wait, the wait for the job to close after this node's workers succeeded,
// and the wait for a static node 0 to come up. Each time the agent leaves
// the rendezvous (the server sees the node go at once, not at lease expiry)
// and exits within about a second. No worker runs in those waits, so
// SIGTERM, a preemption, exits 75 for the job to be requeued (0 once this
// node's workers succeeded), and SIGINT exits 128+SIGINT.
#include <signal.h>

#include <catch2/catch.hpp>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "launcher/endpoint.h"
#include "launcher/worker_env.h"
#include "proto/rendezvous.pb.h"
#include "rendezvous/client/client.h"
#include "rendezvous/client/store.h"
#include "tests/launcher/harness.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

namespace pb = ::muster::rendezvous::v1;
using launcher::Child;

// Long enough that no lease lapses during a test: a node the server drops
// was dropped by its Leave.
constexpr int64_t kLeaseTtlMs = 60000;
// The agent's exit after the signal, with room for a loaded 2-core machine.
constexpr absl::Duration kPromptExit = absl::Seconds(2);

std::vector<std::string> AgentArgs(const std::string& endpoint, const std::string& job) {
  return {"--nnodes=2",  "--nproc_per_node=1", "--rdzv_endpoint",
          endpoint,      "--rdzv_id=" + job,   "--rdzv_conf=lease_ttl=60,last_call_timeout=30",
          "--no_python", "/bin/true"};
}

std::unique_ptr<rdzv::Client> Connect(const std::string& endpoint) {
  rdzv::ClientOptions options;
  options.endpoint = endpoint;
  auto client = rdzv::Client::Connect(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

pb::JobState Describe(rdzv::Client& client, const std::string& job) {
  pb::DescribeJobRequest request;
  request.set_job_id(job);
  auto response = client.DescribeJob(request);
  REQUIRE(response.ok());
  return response->state();
}

bool Holds(rdzv::Client& client, const std::string& job,
           const std::function<bool(const pb::JobState&)>& condition) {
  return WaitUntil(
      [&] {
        pb::DescribeJobRequest request;
        request.set_job_id(job);
        auto response = client.DescribeJob(request);
        return response.ok() && condition(response->state());
      },
      absl::Seconds(30));
}

// Joins `job` as a second node with the agents' settings, so a round of two
// can form; the test plays that node. Keeps its lease until destroyed.
struct FakeNode {
  FakeNode(rdzv::Client* client, const std::string& job, int requested_rank) {
    pb::JoinRequest join;
    join.set_job_id(job);
    join.set_hostname("fake");
    join.set_address("127.0.0.1");
    join.set_nproc(1);
    join.set_requested_rank(requested_rank);
    pb::JobConfig* config = join.mutable_config();
    config->set_min_nodes(2);
    config->set_max_nodes(2);
    config->set_join_timeout_ms(600000);
    config->set_last_call_timeout_ms(30000);
    config->set_lease_ttl_ms(kLeaseTtlMs);
    config->set_max_restarts(0);
    auto joined = client->Join(join);
    INFO(joined.status().ToString());
    REQUIRE(joined.ok());
    member_id = joined->member_id();
    keeper = std::make_unique<rdzv::LeaseKeeper>(client, job, member_id,
                                                 absl::Milliseconds(kLeaseTtlMs));
  }
  std::string member_id;
  std::unique_ptr<rdzv::LeaseKeeper> keeper;
};

// Whether launch's console `log` shows `line` within 30 s: the agent says
// so just before it blocks in that wait (a signal that comes between the
// two is seen by the wait at once), so no settling time is guessed.
bool Logged(const std::string& log, const std::string& line) {
  return WaitUntil([&] { return absl::StrContains(ReadFile(log), line); }, absl::Seconds(30));
}

// Sends `signal_number`; returns how long the agent took to exit (REQUIREs
// it did, within 10 s, with `expected_code`).
absl::Duration SignalAndTime(Child& agent, const std::string& log, int signal_number,
                             int expected_code) {
  absl::Time sent = absl::Now();
  REQUIRE(kill(agent.pid(), signal_number) == 0);
  auto exit = agent.WaitFor(absl::Seconds(10));
  absl::Duration took = absl::Now() - sent;
  INFO(ReadFile(log));
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == expected_code);
  WARN("exited " << absl::FormatDuration(took) << " after signal " << signal_number);
  return took;
}

// SIGTERM while no worker runs: nothing is unsaved, so the agent exits 75
// (launcher::kPreemptedExitCode) and says so.
absl::Duration TerminateAndTime(Child& agent, const std::string& log) {
  absl::Duration took = SignalAndTime(agent, log, SIGTERM, launcher::kPreemptedExitCode);
  CHECK_THAT(ReadFile(log), Catch::Contains("no worker was running"));
  return took;
}

TEST_CASE("SIGTERM while gathering: the agent leaves and exits at once") {
  TempDir dir;
  auto server = StartServer();
  auto client = Connect(server->endpoint());
  Child agent = StartLaunch(AgentArgs(server->endpoint(), "gather"), dir.File("agent.log"));
  // Alone in a job of 2: it waits for a round that cannot form yet.
  REQUIRE(Holds(*client, "gather", [](const pb::JobState& s) { return s.nodes_pending() == 1; }));
  REQUIRE(Logged(dir.File("agent.log"), "waiting for round 0 of job gather to form"));
  CHECK(TerminateAndTime(agent, dir.File("agent.log")) < kPromptExit);
  pb::JobState state = Describe(*client, "gather");
  CHECK(state.nodes_pending() == 0);  // by its Leave: the lease has a minute left
  CHECK(state.waiting_size() == 0);
}

TEST_CASE("SIGINT while gathering: the agent leaves and exits 128+SIGINT") {
  TempDir dir;
  auto server = StartServer();
  auto client = Connect(server->endpoint());
  Child agent = StartLaunch(AgentArgs(server->endpoint(), "interrupt"), dir.File("agent.log"));
  REQUIRE(
      Holds(*client, "interrupt", [](const pb::JobState& s) { return s.nodes_pending() == 1; }));
  REQUIRE(Logged(dir.File("agent.log"), "waiting for round 0 of job interrupt to form"));
  CHECK(SignalAndTime(agent, dir.File("agent.log"), SIGINT, 128 + SIGINT) < kPromptExit);
  CHECK(Describe(*client, "interrupt").nodes_pending() == 0);
}

TEST_CASE("SIGTERM while waiting for MASTER_PORT: the agent leaves the round") {
  TempDir dir;
  auto server = StartServer();
  auto client = Connect(server->endpoint());
  // The fake node is group rank 0 and never publishes a port, so the agent
  // (rank 1) waits for it.
  FakeNode rank0(client.get(), "port", 0);
  Child agent = StartLaunch(AgentArgs(server->endpoint(), "port"), dir.File("agent.log"));
  REQUIRE(Holds(*client, "port", [](const pb::JobState& s) {
    return s.phase() == pb::RUNNING && s.members_size() == 2;
  }));
  REQUIRE(Logged(dir.File("agent.log"), "waiting for group rank 0 to publish the master port"));
  CHECK(TerminateAndTime(agent, dir.File("agent.log")) < kPromptExit);
  pb::JobState state = Describe(*client, "port");
  CHECK(state.round() == 1);
  CHECK(state.last_end_reason() == pb::MEMBER_LEFT);
  CHECK(state.phase() == pb::GATHERING);
}

TEST_CASE("SIGTERM while waiting for the job to close after this node is done") {
  TempDir dir;
  auto server = StartServer();
  auto client = Connect(server->endpoint());
  Child agent = StartLaunch(AgentArgs(server->endpoint(), "done"), dir.File("agent.log"));
  REQUIRE(Holds(*client, "done", [](const pb::JobState& s) { return s.nodes_pending() == 1; }));
  // The agent is rank 0 (it joined first); the fake node never reports done.
  FakeNode rank1(client.get(), "done", -1);
  REQUIRE(Holds(*client, "done", [](const pb::JobState& s) {
    return s.phase() == pb::RUNNING && s.nodes_done() == 1;
  }));
  REQUIRE(Logged(dir.File("agent.log"), "waiting for the job to close"));
  // This node's part succeeded: 0, not a 75 that would requeue a job that
  // may yet succeed.
  CHECK(SignalAndTime(agent, dir.File("agent.log"), SIGTERM, 0) < kPromptExit);
  // A done member's Leave keeps it on the roster: the round may still
  // succeed once the fake node is done.
  CHECK(Describe(*client, "done").phase() == pb::RUNNING);
}

// Whether `pid` has a handler for `signal_number` (/proc/PID/status SigCgt).
bool CatchesSignal(int pid, int signal_number) {
  for (absl::string_view line :
       absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/status")), '\n')) {
    uint64_t mask = 0;
    if (absl::ConsumePrefix(&line, "SigCgt:\t") && absl::SimpleHexAtoi(line, &mask)) {
      return (mask >> (signal_number - 1)) & 1;
    }
  }
  return false;
}

TEST_CASE("SIGTERM while a worker waits for peers who never come: it exits 75 at half the grace") {
  TempDir dir;
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 4000; ++i) tokens.push_back("abcdefghijklm"[i % 13]);
  REQUIRE(worker::WriteTokenShard(dir.File("train_000.bin"), tokens).ok());
  WriteFile(
      dir.File("t.yaml"),
      absl::StrCat("model: {layers: 1, heads: 2, dim: 32, vocab: 256, seq_len: 16}\n",
                   "data: {train: \"", dir.File("train_*.bin"), "\", micro_batch: 2}\n",
                   "train: {steps: 1000}\n", "device: cpu\n", "parallel: {timeout_s: 120}\n"));
  auto server = StartServer();
  auto client = Connect(server->endpoint());
  Child agent = StartLaunch(
      {"--nnodes=2", "--nproc_per_node=1", "--rdzv_endpoint", server->endpoint(), "--rdzv_id=peers",
       "--rdzv_conf=lease_ttl=60,last_call_timeout=30", "--preempt_grace=4", "--no_python",
       BinaryPath("worker/worker"), dir.File("t.yaml")},
      dir.File("agent.log"));
  REQUIRE(Holds(*client, "peers", [](const pb::JobState& s) { return s.nodes_pending() == 1; }));
  // The agent is group rank 0 and starts its worker; the fake node, rank 1,
  // never starts one, as when its agent was preempted before it did. The
  // worker waits for rank 1 in its start-up, with no step trained.
  FakeNode rank1(client.get(), "peers", -1);
  int worker = 0;
  const bool started = WaitUntil(
      [&] {
        // The agent's one child (its name is "exe" once the worker has
        // re-executed itself to set up OpenBLAS).
        worker = FindChild(agent.pid(), [](int) { return true; });
        return worker > 0 && CatchesSignal(worker, SIGTERM);
      },
      absl::Seconds(30));
  INFO(ReadFile(dir.File("agent.log")));
  REQUIRE(started);
  absl::Time sent = absl::Now();
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  auto exit = agent.WaitFor(absl::Seconds(20));
  absl::Duration took = absl::Now() - sent;
  const std::string log = ReadFile(dir.File("agent.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  // Not SIGKILLed at the end of the 4 s grace (which made it 128+SIGTERM,
  // "not clean", and a scheduler would not requeue the job): the worker
  // left at 2 s, and the preemption is clean.
  CHECK(exit->ShellCode() == launcher::kPreemptedExitCode);
  CHECK(took >= absl::Seconds(2));
  CHECK(took < absl::Seconds(4));
  CHECK_THAT(log, Catch::Contains("preempted before training began"));
  CHECK_THAT(log, Catch::Contains("this node's workers saved their state"));
  CHECK(ProcessGone(worker));
}

TEST_CASE("SIGTERM while a static node waits for node 0's service") {
  TempDir dir;
  absl::StatusOr<int> port = launcher::PickFreePort();
  REQUIRE(port.ok());
  Child agent = StartLaunch(
      {"--rdzv_backend=static", "--nnodes=2", "--node_rank=1", "--master_addr=127.0.0.1",
       absl::StrCat("--master_port=", *port), "--no_python", "/bin/true"},
      dir.File("agent.log"));
  // Connecting, with nobody listening.
  REQUIRE(Logged(dir.File("agent.log"), "connecting to the rendezvous service at 127.0.0.1:"));
  CHECK(TerminateAndTime(agent, dir.File("agent.log")) < kPromptExit);
}

// The `rendezvous` binary on 127.0.0.1:`port` (0: any), with its state in
// `state_dir` ("" keeps it in memory), for tests that stop and start it.
std::unique_ptr<tools::ServerProcess> StartServerOn(int port, const std::string& state_dir) {
  tools::ServerProcessOptions options;
  options.binary = BinaryPath("rendezvous/rendezvous");
  options.listen = absl::StrCat("127.0.0.1:", port);
  options.extra_args = {"--log-level", "warn"};
  if (!state_dir.empty()) {
    options.extra_args.insert(options.extra_args.end(), {"--state-dir", state_dir});
  }
  auto server = tools::ServerProcess::Start(options);
  INFO(server.status().ToString());
  REQUIRE(server.ok());
  return *std::move(server);
}

// A preemption while the service restarts: the agent keeps trying to leave
// until shortly before its grace ends, so its node does not become a lost
// node when the lease lapses (a restart charged to the job; with a budget
// of 0 the job failed and refused its own requeue).
TEST_CASE("SIGTERM while the service is down: the agent leaves once it is back, then exits 75") {
  TempDir dir;
  auto start_server = [&](int port) { return StartServerOn(port, dir.File("state")); };
  auto server = start_server(0);
  const int port = server->port();
  const std::string endpoint = server->endpoint();
  Child agent = StartLaunch(
      {"--nnodes=1", "--nproc_per_node=1", "--rdzv_endpoint", endpoint, "--rdzv_id=outage",
       "--rdzv_conf=lease_ttl=60", "--preempt_grace=20", "--no_python", "/bin/sh", "-c",
       "trap 'exit 75' TERM; echo up > " + dir.File("up") + "; while :; do sleep 0.05; done"},
      dir.File("agent.log"));
  REQUIRE(WaitUntil([&] { return ReadFile(dir.File("up")) == "up\n"; }, absl::Seconds(30)));
  REQUIRE(server->Kill(SIGKILL).ok());
  REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  REQUIRE(Logged(dir.File("agent.log"), "could not leave job outage yet"));
  server = start_server(port);
  auto exit = agent.WaitFor(absl::Seconds(30));
  const std::string log = ReadFile(dir.File("agent.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == launcher::kPreemptedExitCode);
  CHECK(absl::StrContains(log, "left job outage"));
  // Gone by its Leave (the lease had a minute left), so nothing is charged.
  auto client = Connect(endpoint);
  pb::JobState state = Describe(*client, "outage");
  CHECK(state.members_size() == 0);
  CHECK(state.restart_count() == 0);
  CHECK(state.phase() != pb::FAILED);
}

// Workers that finish while the service restarts: the agent reports them
// done once it is back (it gave up at once, exited 0, and the server later
// counted the node lost and restarted a finished job).
TEST_CASE("workers done while the service is down: the report goes through once it is back") {
  TempDir dir;
  auto start_server = [&](int port) { return StartServerOn(port, dir.File("state")); };
  auto server = start_server(0);
  const int port = server->port();
  const std::string endpoint = server->endpoint();
  Child agent = StartLaunch(
      {"--nnodes=1", "--nproc_per_node=1", "--rdzv_endpoint", endpoint, "--rdzv_id=done_outage",
       "--rdzv_conf=lease_ttl=60", "--no_python", "/bin/sh", "-c",
       "echo up > " + dir.File("up") + "; while [ ! -e " + dir.File("go") +
           " ]; do sleep 0.05; done"},
      dir.File("agent.log"));
  REQUIRE(WaitUntil([&] { return ReadFile(dir.File("up")) == "up\n"; }, absl::Seconds(30)));
  REQUIRE(server->Kill(SIGKILL).ok());
  REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
  WriteFile(dir.File("go"), "");
  REQUIRE(Logged(dir.File("agent.log"),
                 "could not report this node's workers done in job "
                 "done_outage yet"));
  server = start_server(port);
  auto exit = agent.WaitFor(absl::Seconds(30));
  const std::string log = ReadFile(dir.File("agent.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == 0);
  CHECK(absl::StrContains(log, "reported this node's workers done in job done_outage"));
  auto client = Connect(endpoint);
  pb::JobState state = Describe(*client, "done_outage");
  CHECK(state.phase() == pb::SUCCEEDED);
  CHECK(state.restart_count() == 0);
}

// `count` agents of a job at `endpoint`, each with one worker that says
// "up" in dir/up and then runs until dir/go exists; returns once all are up.
std::vector<Child> StartNodesUntilGo(const TempDir& dir, const std::string& endpoint, int count,
                                     const std::vector<std::string>& flags) {
  std::vector<Child> agents;
  for (int node = 0; node < count; ++node) {
    std::vector<std::string> args = {absl::StrCat("--nnodes=", count), "--nproc_per_node=1",
                                     "--rdzv_endpoint", endpoint};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {"--no_python", "/bin/sh", "-c",
                             "echo up >> " + dir.File("up") + "; while [ ! -e " + dir.File("go") +
                                 " ]; do sleep 0.05; done"});
    agents.push_back(StartLaunch(args, dir.File(absl::StrCat("agent", node, ".log"))));
  }
  std::string all_up;
  for (int node = 0; node < count; ++node) all_up += "up\n";
  REQUIRE(WaitUntil([&] { return ReadFile(dir.File("up")) == all_up; }, absl::Seconds(30)));
  return agents;
}

// Lets StartNodesUntilGo's workers finish; every agent exits 0.
void GoAndExpectSuccess(const TempDir& dir, std::vector<Child>& agents) {
  WriteFile(dir.File("go"), "");
  for (size_t node = 0; node < agents.size(); ++node) {
    auto exit = agents[node].WaitFor(absl::Seconds(30));
    INFO(ReadFile(dir.File(absl::StrCat("agent", node, ".log"))));
    REQUIRE(exit.has_value());
    CHECK(exit->ShellCode() == 0);
  }
}

// A rolling restart of the service (SIGTERM, then a new server on the same
// state): a graceful stop cancels the calls in flight, and a lease renewal
// cancelled so was taken as a lost lease (exit 1, the node lost).
TEST_CASE("graceful restarts of the service leave a running job alone") {
  TempDir dir;
  auto start_server = [&](int port) { return StartServerOn(port, dir.File("state")); };
  auto server = start_server(0);
  const int port = server->port();
  const std::string endpoint = server->endpoint();
  std::vector<Child> agents =
      StartNodesUntilGo(dir, endpoint, 2, {"--rdzv_id=rolling", "--rdzv_conf=lease_ttl=3"});
  for (int restart = 0; restart < 6; ++restart) {
    REQUIRE(server->Kill(SIGTERM).ok());
    REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
    server = start_server(port);
    // Renewals every second (ttl 3): each restart has some in flight.
    absl::SleepFor(absl::Milliseconds(700));
  }
  GoAndExpectSuccess(dir, agents);
  CHECK(ReadFile(dir.File("up")) == "up\nup\n");  // never restarted
  auto client = Connect(endpoint);
  pb::JobState state = Describe(*client, "rolling");
  CHECK(state.phase() == pb::SUCCEEDED);
  CHECK(state.restart_count() == 0);
}

// The service restarted without its state: every node has lost its lease
// and joins the job, made anew, as a new node. The agents read the new
// job's states against the old one's (whose round 0 held their new member
// ids) and failed "cannot agree on MASTER_PORT".
TEST_CASE("a service restarted without its state: the nodes form the job again") {
  TempDir dir;
  auto start_server = [&](int port) { return StartServerOn(port, ""); };
  auto server = start_server(0);
  const int port = server->port();
  const std::string endpoint = server->endpoint();
  std::vector<Child> agents = StartNodesUntilGo(
      dir, endpoint, 2, {"--rdzv_id=amnesia", "--max_restarts=3", "--rdzv_conf=lease_ttl=2"});
  REQUIRE(server->Kill(SIGKILL).ok());
  REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
  server = start_server(port);
  REQUIRE(
      WaitUntil([&] { return ReadFile(dir.File("up")) == "up\nup\nup\nup\n"; }, absl::Seconds(30)));
  GoAndExpectSuccess(dir, agents);
  for (int node = 0; node < 2; ++node) {
    CHECK(absl::StrContains(ReadFile(dir.File(absl::StrCat("agent", node, ".log"))),
                            "joining job amnesia again as a new node"));
  }
}

}  // namespace
}  // namespace muster::testing
