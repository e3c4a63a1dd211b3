// End to end: the real `rendezvous` binary as a child process, many clients,
// lease expiry, and server restarts (SIGTERM and SIGKILL) with --state-dir.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "rendezvous/client/client.h"
#include "rendezvous/client/store.h"
#include "tests/rendezvous/client/test_util.h"
#include "tools/server_process.h"

namespace muster::rdzv {
namespace {

using tools::ServerProcess;
using tools::ServerProcessOptions;

std::string ServerBinary() {
  for (const char* root : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    if (const char* dir = std::getenv(root)) {
      return absl::StrCat(dir, "/muster/rendezvous/rendezvous");
    }
  }
  return tools::ExecutableDir() + "/end_to_end_test.runfiles/muster/rendezvous/rendezvous";
}

std::unique_ptr<ServerProcess> StartServer(const std::string& listen,
                                           std::vector<std::string> args = {}) {
  ServerProcessOptions options;
  options.binary = ServerBinary();
  options.listen = listen;
  options.extra_args = std::move(args);
  options.echo_output = true;  // the server's log lands in test.log
  auto server = ServerProcess::Start(options);
  INFO(server.status().ToString());
  REQUIRE(server.ok());
  return *std::move(server);
}

bool SameMembers(const pb::JobState& a, const pb::JobState& b) {
  if (a.members_size() != b.members_size()) return false;
  for (int i = 0; i < a.members_size(); ++i) {
    if (a.members(i).member_id() != b.members(i).member_id() ||
        a.members(i).group_rank() != b.members(i).group_rank() ||
        a.members(i).rank_offset() != b.members(i).rank_offset()) {
      return false;
    }
  }
  return true;
}

TEST_CASE("64 clients join one job and all see the same world", "[e2e]") {
  auto server = StartServer("127.0.0.1:0");
  constexpr int kNodes = 64;
  const pb::JobConfig config = testing::Config(kNodes, kNodes, 10000);
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kNodes; ++i) clients.push_back(testing::ConnectTo(server->port()));

  std::vector<absl::StatusOr<RoundAssignment>> results(kNodes);
  std::vector<std::thread> nodes;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (int i = 0; i < kNodes; ++i) {
    nodes.emplace_back([&, i] {
      results[i] = JoinAndWaitForRound(
          *clients[i], testing::JoinRequestFor("big", config, i, 1 + i % 4), nullptr, deadline);
    });
  }
  for (auto& node : nodes) node.join();

  std::set<std::string> member_ids;
  std::set<int> ranks;
  for (int i = 0; i < kNodes; ++i) {
    INFO("node " << i << ": " << results[i].status().ToString());
    REQUIRE(results[i].ok());
    const RoundAssignment& mine = *results[i];
    CHECK(mine.state.round() == results[0]->state.round());
    CHECK(SameMembers(mine.state, results[0]->state));
    CHECK(mine.self.member_id() == mine.member_id);
    CHECK(mine.self.nproc() == static_cast<uint32_t>(1 + i % 4));
    member_ids.insert(mine.member_id);
    ranks.insert(mine.self.group_rank());
  }
  CHECK(member_ids.size() == kNodes);
  REQUIRE(ranks.size() == kNodes);
  CHECK(*ranks.begin() == 0);
  CHECK(*ranks.rbegin() == kNodes - 1);

  // Offsets are the prefix sums of nproc in group-rank order.
  const pb::JobState& world = results[0]->state;
  uint32_t offset = 0;
  for (int rank = 0; rank < world.members_size(); ++rank) {
    CHECK(world.members(rank).group_rank() == rank);
    CHECK(world.members(rank).rank_offset() == offset);
    offset += world.members(rank).nproc();
  }
  CHECK(world.world_size() == offset);
}

TEST_CASE("An expired lease reaches the other members within ttl + 1 s", "[e2e][lease]") {
  auto server = StartServer("127.0.0.1:0");
  const absl::Duration ttl = absl::Seconds(1);
  const pb::JobConfig config = testing::Config(2, 3, 1000);
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<absl::StatusOr<RoundAssignment>> joined(3);
  std::vector<std::thread> nodes;
  for (int i = 0; i < 3; ++i) clients.push_back(testing::ConnectTo(server->port()));
  for (int i = 0; i < 3; ++i) {
    nodes.emplace_back([&, i] {
      joined[i] = JoinAndWaitForRound(*clients[i], testing::JoinRequestFor("lease", config, i, 1),
                                      nullptr, absl::Now() + absl::Seconds(20));
    });
  }
  for (auto& node : nodes) node.join();
  for (auto& result : joined) REQUIRE(result.ok());
  const uint64_t round = joined[0]->state.round();
  REQUIRE(joined[0]->state.members_size() == 3);

  std::vector<std::unique_ptr<LeaseKeeper>> keepers;
  for (int i = 0; i < 3; ++i) {
    keepers.push_back(
        std::make_unique<LeaseKeeper>(clients[i].get(), "lease", joined[i]->member_id, ttl));
  }
  JobWatcher watcher0(clients[0].get(), "lease");
  JobWatcher watcher1(clients[1].get(), "lease");

  const absl::Time stopped = absl::Now();
  keepers[2]->Stop();  // node 2 goes silent
  for (JobWatcher* watcher : {&watcher0, &watcher1}) {
    auto told = watcher->WaitFor([&](const pb::JobState& s) { return s.round() > round; },
                                 stopped + absl::Seconds(10));
    REQUIRE(told.ok());
    const absl::Duration latency = absl::Now() - stopped;
    INFO("told after " << absl::FormatDuration(latency));
    CHECK(latency <= ttl + absl::Seconds(1));
    CHECK(told->last_end_reason() == pb::MEMBER_LOST);
  }
  CHECK(keepers[0]->status().ok());
  CHECK(keepers[1]->status().ok());
}

TEST_CASE("The job carries on across server restarts with --state-dir", "[e2e][restart]") {
  const std::string state_dir = absl::StrCat(testing::TempDir(), "/e2e_state_", getpid(), "_",
                                             absl::ToUnixMicros(absl::Now()));
  const std::vector<std::string> args = {"--state-dir", state_dir};
  auto server = StartServer("127.0.0.1:0", args);
  const std::string listen = server->endpoint();
  const absl::Duration ttl = absl::Seconds(2);
  const pb::JobConfig config = testing::Config(2, 2, 2000);

  std::vector<std::unique_ptr<Client>> clients;
  std::vector<absl::StatusOr<RoundAssignment>> joined(2);
  for (int i = 0; i < 3; ++i) clients.push_back(testing::ConnectTo(server->port()));
  {
    std::thread other([&] {
      joined[1] = JoinAndWaitForRound(*clients[1], testing::JoinRequestFor("durable", config, 1, 2),
                                      nullptr, absl::Now() + absl::Seconds(20));
    });
    joined[0] = JoinAndWaitForRound(*clients[0], testing::JoinRequestFor("durable", config, 0, 2),
                                    nullptr, absl::Now() + absl::Seconds(20));
    other.join();
  }
  REQUIRE(joined[0].ok());
  REQUIRE(joined[1].ok());
  const pb::JobState before = joined[0]->state;
  const uint64_t round = before.round();

  std::vector<std::unique_ptr<LeaseKeeper>> keepers;
  std::vector<std::unique_ptr<JobWatcher>> watchers;
  for (int i = 0; i < 2; ++i) {
    keepers.push_back(
        std::make_unique<LeaseKeeper>(clients[i].get(), "durable", joined[i]->member_id, ttl));
    watchers.push_back(std::make_unique<JobWatcher>(clients[i].get(), "durable"));
  }
  RemoteStore store(clients[0].get(), "durable", round);
  REQUIRE(store.Set("master_addr", "10.1.0.0:29500").ok());

  // A spare node joins after the first restart and leaves after the second;
  // each changes nodes_waiting, which the reconnected watchers must see.
  std::string spare_id;
  std::unique_ptr<LeaseKeeper> spare_keeper;
  int restart = 0;
  for (int signal : {SIGTERM, SIGKILL}) {
    ++restart;
    INFO("restart " << restart << " with signal " << signal);
    const int reconnects_before = watchers[0]->reconnects();
    REQUIRE(server->Kill(signal).ok());
    REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
    server = StartServer(listen, args);

    uint32_t expect_waiting;
    if (restart == 1) {
      auto spare = clients[2]->Join(testing::JoinRequestFor("durable", config, 2, 2));
      REQUIRE(spare.ok());
      spare_id = spare->member_id();
      spare_keeper = std::make_unique<LeaseKeeper>(clients[2].get(), "durable", spare_id, ttl);
      expect_waiting = 1;
    } else {
      spare_keeper->Stop();
      pb::LeaveRequest leave;
      leave.set_job_id("durable");
      leave.set_member_id(spare_id);
      // Leave is not retried by the client (not idempotent); a call that
      // raced the dying connection may come back UNAVAILABLE. Retrying is
      // safe here: NOT_FOUND would mean the first attempt went through.
      auto left = clients[2]->Leave(leave);
      if (left.status().code() == absl::StatusCode::kUnavailable) {
        left = clients[2]->Leave(leave);
      }
      INFO("Leave: " << left.status().ToString());
      REQUIRE((left.ok() || left.status().code() == absl::StatusCode::kNotFound));
      expect_waiting = 0;
    }
    for (auto& watcher : watchers) {
      auto seen = watcher->WaitFor(
          [&](const pb::JobState& s) { return s.nodes_waiting() == expect_waiting; },
          absl::Now() + absl::Seconds(10));
      REQUIRE(seen.ok());
      INFO("state seen: " << seen->ShortDebugString());
      INFO("keeper 0: " << keepers[0]->status().ToString() << ", " << keepers[0]->renewals()
                        << " renewals (" << keepers[0]->last_transient_error().ToString()
                        << "); keeper 1: " << keepers[1]->status().ToString() << ", "
                        << keepers[1]->renewals() << " renewals");
      CHECK(seen->phase() == pb::RUNNING);
      CHECK(seen->round() == round);
      CHECK(SameMembers(*seen, before));
    }
    CHECK(watchers[0]->reconnects() > reconnects_before);

    // The store kept its keys; the members and their leases survived.
    auto value = store.Get("master_addr", absl::ZeroDuration());
    REQUIRE(value.ok());
    CHECK(*value == "10.1.0.0:29500");
    for (int i = 0; i < 2; ++i) {
      pb::KeepAliveRequest keep_alive;
      keep_alive.set_job_id("durable");
      keep_alive.set_member_id(joined[i]->member_id);
      CHECK(clients[i]->KeepAlive(keep_alive).ok());
    }
  }
  // A full ttl after the last restart nobody has been declared lost.
  auto lost = watchers[0]->WaitFor(
      [&](const pb::JobState& s) { return s.round() != round || s.phase() != pb::RUNNING; },
      absl::Now() + ttl + absl::Milliseconds(500));
  CHECK(lost.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(keepers[0]->status().ok());
  CHECK(keepers[1]->status().ok());
  CHECK(watchers[0]->status().ok());

  REQUIRE(server->Kill(SIGTERM).ok());
  auto exit_status = server->Wait(absl::Now() + absl::Seconds(10));
  REQUIRE(exit_status.ok());
  CHECK(WIFEXITED(*exit_status));
  CHECK(WEXITSTATUS(*exit_status) == 0);
}

// gRPC 1.51 fails fail-fast calls for seconds after a server comes back;
// the client's wait_for_ready calls must not (see rendezvous/client/rpc.h).
TEST_CASE("Calls get through promptly once a killed server is back", "[e2e][restart]") {
  auto server = StartServer("127.0.0.1:0");
  const std::string listen = server->endpoint();
  auto client = testing::ConnectTo(server->port());
  REQUIRE(client->ListJobs().ok());
  for (int signal : {SIGTERM, SIGKILL}) {
    INFO("signal " << signal);
    REQUIRE(server->Kill(signal).ok());
    REQUIRE(server->Wait(absl::Now() + absl::Seconds(10)).ok());
    CallOptions short_call;
    short_call.timeout = absl::Milliseconds(200);
    CHECK(client->ListJobs({}, short_call).status().code() ==
          absl::StatusCode::kUnavailable);  // down: "unreachable"
    server = StartServer(listen);
    const absl::Time up = absl::Now();
    CallOptions call;
    call.timeout = absl::Seconds(5);
    CHECK(client->ListJobs({}, call).ok());
    CHECK(absl::Now() - up < absl::Seconds(1));
  }
}

}  // namespace
}  // namespace muster::rdzv
