// A handled signal ends every wait of a real `launch` agent, not only the
// loop that watches its workers: gathering for a round, the MASTER_PORT
// wait, the wait for the job to close after this node's workers succeeded,
// and the wait for a static node 0 to come up. Each time the agent leaves
// the rendezvous (the server sees the node go at once, not at lease expiry)
// and exits 128+signal within about a second.
#include <signal.h>

#include <catch2/catch.hpp>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "launcher/endpoint.h"
#include "proto/rendezvous.pb.h"
#include "rendezvous/client/client.h"
#include "rendezvous/client/store.h"
#include "tests/launcher/harness.h"

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

// Sends SIGTERM; returns how long the agent took to exit (REQUIREs it did,
// within 10 s, with 128+SIGTERM).
absl::Duration TerminateAndTime(Child& agent, const std::string& log) {
  absl::Time sent = absl::Now();
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  auto exit = agent.WaitFor(absl::Seconds(10));
  absl::Duration took = absl::Now() - sent;
  INFO(ReadFile(log));
  REQUIRE(exit.has_value());
  CHECK(exit->ShellCode() == 128 + SIGTERM);
  WARN("exited " << absl::FormatDuration(took) << " after SIGTERM");
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
  CHECK(TerminateAndTime(agent, dir.File("agent.log")) < kPromptExit);
  // A done member's Leave keeps it on the roster: the round may still
  // succeed once the fake node is done.
  CHECK(Describe(*client, "done").phase() == pb::RUNNING);
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

}  // namespace
}  // namespace muster::testing
