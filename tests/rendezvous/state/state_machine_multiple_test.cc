// JobConfig.world_size_multiple: rounds close only on a world that is a
// multiple of it, the other nodes wait as spares, and nodes_admittable
// tells agents whether restarting would admit any of them.
#include <catch2/catch.hpp>

#include "rendezvous/state/state_machine.h"
#include "tests/rendezvous/state/state_machine_test_util.h"

namespace muster::rdzv {
namespace {

using testing::Config;
using testing::Harness;
using testing::JoinArgs;

pb::JobConfig Multiple(uint32_t min_nodes, uint32_t max_nodes, uint32_t multiple) {
  pb::JobConfig config = Config(min_nodes, max_nodes, /*last_call_ms=*/1000);
  config.set_world_size_multiple(multiple);
  return config;
}

TEST_CASE("a round waits for a world that is a multiple, then leaves the odd node waiting") {
  Harness h;
  auto config = Multiple(1, 4, 2);
  config.set_lease_ttl_ms(120'000);
  std::string a = h.Join("j1", config);
  // One node is min_nodes, but a world of 1 is not a multiple of 2: no last
  // call starts, only the join timeout runs.
  REQUIRE(h.machine.NextDeadline() == h.now + absl::Seconds(60));
  h.Advance(absl::Seconds(5));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  std::string b = h.Join("j1", config);
  std::string c = h.Join("j1", config);
  REQUIRE(h.machine.NextDeadline() == h.now + absl::Seconds(1));
  h.Advance(absl::Seconds(1));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.world_size() == 2);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b});
  REQUIRE(state.nodes_waiting() == 1);
  // c cannot be admitted alone: agents must not restart for it.
  REQUIRE(state.nodes_admittable() == 0);

  std::string d = h.Join("j1", config);
  state = h.State("j1");
  REQUIRE(state.nodes_waiting() == 2);
  REQUIRE(state.nodes_admittable() == 2);
  h.Rejoin("j1", config, a);
  h.Rejoin("j1", config, b);
  state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);  // max_nodes reached at once
  REQUIRE(state.world_size() == 4);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b, c, d});
}

TEST_CASE("without a multiple, every waiting node below max is admittable") {
  Harness h;
  auto config = Config(2, 3, 100);
  h.Join("j1", config);
  h.Join("j1", config);
  h.Advance(absl::Milliseconds(100));
  h.Join("j1", config);
  h.Join("j1", config);
  pb::JobState state = h.State("j1");
  REQUIRE(state.nodes_waiting() == 2);
  REQUIRE(state.nodes_admittable() == 1);  // max_nodes 3
}

TEST_CASE("after a failure the survivors go first and a spare that does not fit waits") {
  Harness h;
  auto config = Multiple(2, 3, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  std::string c = h.Join("j1", config);  // waits: 3 is not a multiple of 2
  REQUIRE(h.State("j1").nodes_admittable() == 0);
  REQUIRE_OK(h.ReportFailure("j1", 0, a));
  // Pending now: c (it waited), then a and b as they come back. Without a
  // multiple c would run in their place if max_nodes were 2; with one, the
  // previous round's nodes are taken first.
  h.Rejoin("j1", config, b);
  h.Rejoin("j1", config, a);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);  // everyone back
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b});
  REQUIRE(state.nodes_waiting() == 1);
}

TEST_CASE("a lost node lets a spare make the world fit again") {
  Harness h;
  auto config = Multiple(2, 4, 2);
  config.set_lease_ttl_ms(120'000);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  h.Advance(absl::Seconds(1));
  std::string c = h.Join("j1", config);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE(h.State("j1").nodes_waiting() == 1);
  // a's node is gone for good: b and c make a world of 2.
  REQUIRE_OK(h.Leave("j1", a));
  h.Rejoin("j1", config, b);
  h.Advance(absl::Seconds(1));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{b, c});
}

TEST_CASE("nodes of different sizes: the longest fitting prefix runs") {
  Harness h;
  auto config = Multiple(1, 4, 4);
  JoinArgs two;
  two.nproc = 2;
  JoinArgs one;
  one.nproc = 1;
  std::string a = h.Join("j1", config, two);
  std::string b = h.Join("j1", config, one);
  std::string c = h.Join("j1", config, one);
  std::string d = h.Join("j1", config, two);  // 2+1+1+2 = 6: max reached, 4 fits
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.world_size() == 4);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b, c});
  REQUIRE(state.nodes_waiting() == 1);
}

TEST_CASE("a join timeout with enough nodes but no fitting world names the multiple") {
  Harness h;
  auto config = Multiple(2, 4, 4);
  config.set_lease_ttl_ms(120'000);
  JoinArgs two;
  two.nproc = 2;
  h.Join("j1", config, two);
  h.Join("j1", config);  // worlds 2 and 3: neither a multiple of 4
  h.Advance(absl::Seconds(60));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::FAILED);
  REQUIRE_THAT(state.status_message(), Catch::Contains("world_size_multiple 4"));
  REQUIRE_THAT(state.status_message(), Catch::Contains("2 nodes joined round 0"));
}

TEST_CASE("a multiple no node count in range can reach is refused at join") {
  Harness h;
  JoinArgs args;
  args.nproc = 2;
  auto refused = h.TryJoin("j1", Multiple(1, 3, 8), args);  // 2, 4, 6
  REQUIRE_CODE(refused, absl::StatusCode::kInvalidArgument);
  REQUIRE_THAT(std::string(refused.status().message()),
               Catch::Contains("world_size_multiple is 8") && Catch::Contains("nproc 2"));
  REQUIRE_OK(h.TryJoin("j1", Multiple(1, 4, 8), args));  // 4 nodes make 8
  // Huge values answer at once (no search over the range).
  auto huge = h.TryJoin("j2", Multiple(1, 4'000'000'000u, 4'000'000'000u), args);
  REQUIRE_OK(huge);
}

TEST_CASE("a join with another multiple names the setting; 0 and 1 are the same") {
  Harness h;
  h.Join("j1", Multiple(1, 4, 2));
  auto other = h.TryJoin("j1", Multiple(1, 4, 4));
  REQUIRE_CODE(other, absl::StatusCode::kFailedPrecondition);
  REQUIRE_THAT(std::string(other.status().message()),
               Catch::Contains("world_size_multiple is 2 but this join asks for 4"));
  h.Join("j2", Multiple(1, 4, 0));
  h.Join("j2", Multiple(1, 4, 1));
}

TEST_CASE("a restored job keeps its multiple") {
  Harness h;
  auto config = Multiple(1, 4, 2);
  h.Join("j1", config);
  auto snapshot = h.machine.Snapshot(h.now);
  Harness restored;
  restored.now = h.now;
  REQUIRE_OK(restored.machine.Restore(snapshot, restored.now));
  restored.Check();
  REQUIRE(restored.State("j1").config().world_size_multiple() == 2);
  restored.Join("j1", config);
  restored.Advance(absl::Seconds(1));
  REQUIRE(restored.State("j1").phase() == pb::RUNNING);
  REQUIRE(restored.State("j1").world_size() == 2);
}

}  // namespace
}  // namespace muster::rdzv
