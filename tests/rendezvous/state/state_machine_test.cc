// Rounds, leases, restarts, fencing and persistence of the rendezvous state
// machine, driven by a fake `now`. Store and limits: state_machine_store_test.
#include "rendezvous/state/state_machine.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <limits>

#include "tests/rendezvous/state/state_machine_test_util.h"

namespace muster::rdzv {
namespace {

using testing::Config;
using testing::Harness;
using testing::JoinArgs;

constexpr absl::Duration kTtl = absl::Seconds(10);

TEST_CASE("a round closes at max_nodes at once") {
  Harness h;
  auto config = Config(2, 3);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  REQUIRE(h.State("j1").nodes_pending() == 2);
  std::string c = h.Join("j1", config);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.round() == 0);
  REQUIRE(state.world_size() == 3);
  REQUIRE(state.nodes_pending() == 0);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b, c});
  REQUIRE(a != b);
  REQUIRE(a.rfind("host-", 0) == 0);
}

TEST_CASE("at min_nodes a round closes only when last call has passed") {
  Harness h;
  auto config = Config(2, 4, /*last_call_ms=*/1000);
  h.Join("j1", config);
  h.Advance(absl::Milliseconds(300));
  h.Join("j1", config);
  absl::Time min_reached = h.now;
  REQUIRE(h.machine.NextDeadline() == min_reached + absl::Seconds(1));
  h.Advance(absl::Milliseconds(999));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  h.Advance(absl::Milliseconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE(h.State("j1").members_size() == 2);
}

TEST_CASE("after a restart the round closes once every live member is back") {
  Harness h;
  auto config = Config(2, 4);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  std::string c = h.Join("j1", config);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.ReportFailure("j1", 0, b));
  REQUIRE(h.State("j1").round() == 1);
  REQUIRE(h.State("j1").nodes_pending() == 0);  // the reporter re-joins too
  h.Rejoin("j1", config, c);
  h.Rejoin("j1", config, a);
  // Two of three are back: min is met but c, a wait for b or last call.
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  h.Rejoin("j1", config, b);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.round() == 1);
  // Survivors keep their previous order.
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b, c});
}

TEST_CASE("a round below min_nodes after join_timeout fails the job") {
  Harness h;
  auto config = Config(3, 4);
  config.set_lease_ttl_ms(120'000);  // outlive the join timeout
  h.Join("j1", config);
  h.Join("j1", config);
  REQUIRE(h.machine.NextDeadline() == h.now + absl::Seconds(60));
  h.Advance(absl::Seconds(60));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::FAILED);
  REQUIRE_THAT(state.status_message(), Catch::Contains("2 of min_nodes 3"));
  auto late = h.TryJoin("j1", config);
  REQUIRE_CODE(late, absl::StatusCode::kFailedPrecondition);
  REQUIRE_THAT(std::string(late.status().message()),
               Catch::Contains("job \"j1\" is closed (failed at round 0"));
}

TEST_CASE("a late joiner waits and a re-join grows the world") {
  Harness h;
  auto config = Config(2, 4, /*last_call_ms=*/100);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  h.Advance(absl::Milliseconds(100));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  uint64_t version = h.State("j1").version();

  auto late = h.TryJoin("j1", config);
  REQUIRE_OK(late);
  REQUIRE(late->round() == 1);  // gathering for the next round
  std::string c = late->member_id();
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.nodes_waiting() == 1);
  REQUIRE(state.version() > version);

  h.Rejoin("j1", config, a);  // an agent decides to scale up
  state = h.State("j1");
  REQUIRE(state.phase() == pb::GATHERING);
  REQUIRE(state.round() == 1);
  REQUIRE(state.last_end_reason() == pb::MEMBER_REJOINED);
  REQUIRE(state.restart_count() == 0);
  REQUIRE(state.nodes_pending() == 2);  // c (was waiting) and a
  h.Rejoin("j1", config, b);
  state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(state.world_size() == 3);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{a, b, c});
}

TEST_CASE("a spare beyond max takes a lost member's place") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  std::string spare = h.Join("j1", config);
  REQUIRE(h.State("j1").nodes_waiting() == 1);
  REQUIRE(h.machine.member_count() == 3);
  // b and the spare renew every ttl/3; a has gone silent.
  for (int i = 0; i < 3; ++i) {
    h.Advance(kTtl / 3);
    REQUIRE_OK(h.KeepAlive("j1", b));
    REQUIRE_OK(h.KeepAlive("j1", spare));
  }
  h.Advance(kTtl - 3 * (kTtl / 3));
  pb::JobState state = h.State("j1");
  REQUIRE(state.round() == 1);
  REQUIRE(state.phase() == pb::GATHERING);
  REQUIRE(state.last_end_reason() == pb::MEMBER_LOST);
  REQUIRE(state.restart_count() == 1);
  REQUIRE(state.failures_size() == 1);
  REQUIRE(state.failures(0).exit_code() == -1);
  REQUIRE(state.failures(0).message() == "lease of " + a + " expired");
  REQUIRE(h.machine.member_count() == 2);
  REQUIRE_CODE(h.KeepAlive("j1", a), absl::StatusCode::kNotFound);
  h.Rejoin("j1", config, b);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{b, spare});
}

TEST_CASE("the latest joiners beyond max stay waiting as spares") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  h.Join("j1", config);
  std::string c = h.Join("j1", config);
  std::string d = h.Join("j1", config);
  std::string e = h.Join("j1", config);
  REQUIRE(h.State("j1").nodes_waiting() == 3);
  h.Rejoin("j1", config, a);  // pending c, d, e, a: over max at once
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{c, d});
  REQUIRE(state.nodes_waiting() == 2);  // e and a
}

TEST_CASE("a lapsed lease ends the round within ttl and counts a restart") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  absl::Time joined = h.now;
  REQUIRE(h.machine.NextDeadline() == joined + kTtl);
  h.Advance(kTtl - absl::Milliseconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.KeepAlive("j1", b));
  REQUIRE(h.machine.NextDeadline() == joined + kTtl);  // a's lease
  h.Advance(absl::Milliseconds(1));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::GATHERING);
  REQUIRE(state.restart_count() == 1);
  REQUIRE(state.failures(0).member_id() == a);
  REQUIRE(h.machine.member_count() == 1);
}

TEST_CASE("a failure report ends the round and spends the restart budget") {
  Harness h;
  auto config = Config(2, 2, 1000, /*max_restarts=*/1);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  auto after_first = h.ReportFailure("j1", 0, a, /*exit_code=*/3);
  REQUIRE_OK(after_first);
  REQUIRE(after_first->phase() == pb::GATHERING);
  REQUIRE(after_first->restart_count() == 1);
  REQUIRE(after_first->last_end_reason() == pb::MEMBER_FAILED);
  REQUIRE(after_first->failures(0).exit_code() == 3);
  h.Rejoin("j1", config, a);
  h.Rejoin("j1", config, b);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);

  auto after_second = h.ReportFailure("j1", 1, b, /*exit_code=*/9);
  REQUIRE_OK(after_second);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::FAILED);
  REQUIRE(state.round() == 1);
  REQUIRE(state.restart_count() == 2);
  REQUIRE(state.failures_size() == 2);
  REQUIRE_THAT(state.status_message(), Catch::Contains("restart budget of 1 spent"));
  REQUIRE_CODE(h.TryJoin("j1", config), absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a failure no restart can mend fails the job at once, its budget left") {
  Harness h;
  auto config = Config(2, 2, 1000, /*max_restarts=*/3);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  // A restartable failure first: round 1 gathers, one restart spent.
  REQUIRE_OK(h.ReportFailure("j1", 0, a, /*exit_code=*/1));
  h.Rejoin("j1", config, a);
  h.Rejoin("j1", config, b);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);

  auto failed = h.ReportFailure("j1", 1, b, /*exit_code=*/2, /*permanent=*/true);
  REQUIRE_OK(failed);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::FAILED);
  REQUIRE(state.round() == 1);
  REQUIRE(state.restart_count() == 1);  // no restart for it
  REQUIRE(state.failures_size() == 2);
  REQUIRE(state.failures(1).exit_code() == 2);
  REQUIRE(state.last_end_reason() == pb::MEMBER_FAILED);
  REQUIRE_THAT(state.status_message(),
               Catch::Contains("failed without a restart (1 of 3 used), since no restart can mend "
                               "this failure: node ") &&
                   Catch::Contains(", member " + b + ") in round 1: exit code 2"));
  REQUIRE_CODE(h.TryJoin("j1", config), absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a restarted round below min fails join_timeout after it began") {
  Harness h;
  auto config = Config(2, 2);
  config.set_join_timeout_ms(5000);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  h.Advance(absl::Seconds(3));
  REQUIRE_OK(h.ReportFailure("j1", 0, b));
  absl::Time round_end = h.now;
  h.Rejoin("j1", config, a);  // b never comes back but renews its lease
  REQUIRE(h.machine.NextDeadline() == round_end + absl::Seconds(5));
  h.Advance(absl::Seconds(4));
  REQUIRE_OK(h.KeepAlive("j1", b));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  h.Advance(absl::Seconds(1));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::FAILED);
  REQUIRE(state.round() == 1);
  REQUIRE_THAT(state.status_message(), Catch::Contains("1 of min_nodes 2"));
}

// A job every node left (a preempted job, waiting for its requeue) has no
// node waiting for a round: no join timeout runs until one joins again, and
// then from that join. It used to fail at join_timeout after the round
// began, and the requeue was refused: "job is closed".
// A job of two nodes with a 5 s join timeout, as the preemption tests use.
pb::JobConfig PairConfig(int64_t lease_ttl_ms) {
  pb::JobConfig config = Config(2, 2);
  config.set_join_timeout_ms(5000);
  config.set_lease_ttl_ms(lease_ttl_ms);
  return config;
}

TEST_CASE("a round nobody waits for does not time out; the first joiner starts the clock") {
  Harness h;
  auto config = PairConfig(60'000);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  for (const std::string& member : {a, b}) REQUIRE_OK(h.Leave("j1", member));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  // No join timeout; only the idle retention (24 h) runs.
  REQUIRE(h.machine.NextDeadline() == h.now + Limits().idle_retention);
  h.Advance(absl::Hours(2));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  // The requeue: one node back starts the 5 s; both back form the round.
  h.Join("j1", config);
  REQUIRE(h.machine.NextDeadline() == h.now + absl::Seconds(5));
  h.Advance(absl::Seconds(4));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  h.Join("j1", config);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
}

TEST_CASE("a spare left alone by a preemption does not start the join timeout") {
  Harness h;
  auto config = PairConfig(36'000'000);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  std::string spare = h.Join("j1", config);  // beyond max_nodes: waits
  REQUIRE(h.State("j1").nodes_waiting() == 1);
  // Both members are preempted (they leave); the spare is now pending for
  // round 1, alone. Before, it started the 5 s join timeout, the job
  // FAILED, and its requeue got "job is closed".
  for (const std::string& member : {a, b}) REQUIRE_OK(h.Leave("j1", member));
  REQUIRE(h.State("j1").nodes_pending() == 1);
  REQUIRE(h.machine.NextDeadline() > h.now + absl::Hours(9));  // the spare's lease only
  h.Advance(absl::Hours(2));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  // The requeue's first node makes two: the round forms.
  h.Join("j1", config);
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::RUNNING);  // the spare and the requeued node
  REQUIRE(state.members_size() == 2);

  // A spare left by members that were lost (not a preemption) still
  // times out: nobody will requeue dead nodes.
  Harness lost;
  config.set_lease_ttl_ms(1000);
  config.set_max_restarts(5);
  lost.Join("j2", config);
  lost.Join("j2", config);
  std::string kept = lost.Join("j2", config);
  for (int i = 0; i < 3; ++i) {
    lost.Advance(absl::Milliseconds(400));
    REQUIRE_OK(lost.KeepAlive("j2", kept));
  }
  REQUIRE(lost.State("j2").phase() == pb::GATHERING);
  REQUIRE(lost.State("j2").last_end_reason() == pb::MEMBER_LOST);
  for (int i = 0; i < 13; ++i) {
    lost.Advance(absl::Milliseconds(400));
    if (lost.State("j2").phase() != pb::GATHERING) break;
    REQUIRE_OK(lost.KeepAlive("j2", kept));
  }
  REQUIRE(lost.State("j2").phase() == pb::FAILED);
  REQUIRE_THAT(lost.State("j2").status_message(), Catch::Contains("join timeout"));
}

TEST_CASE("a job every member left is dropped after idle_retention, unless one comes back") {
  Limits limits;
  limits.idle_retention = absl::Hours(1);
  Harness h(limits);
  auto config = Config(1, 2);
  config.set_lease_ttl_ms(7'200'000);  // outlives every step below
  std::string a = h.Join("j1", config);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.Leave("j1", a));
  h.Advance(absl::Minutes(59));
  REQUIRE(h.State("j1").phase() == pb::GATHERING);
  // A requeue within the hour keeps the job, and its clock starts again
  // only when the last member goes again.
  std::string b = h.Join("j1", config);
  h.Advance(absl::Minutes(30));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.Leave("j1", b));
  h.Advance(absl::Minutes(59));
  REQUIRE(h.machine.State("j1").ok());
  h.Advance(absl::Minutes(1));
  REQUIRE_CODE(h.machine.State("j1"), absl::StatusCode::kNotFound);
  REQUIRE(h.machine.job_count() == 0);
  // The id is free: a requeue after that is a new job at round 0.
  h.Join("j1", config);
  REQUIRE(h.State("j1").round() == 0);

  // A lease that lapses makes a job idle the same way.
  config.set_lease_ttl_ms(600'000);
  h.Join("j2", config);
  h.Advance(absl::Milliseconds(600'000));
  REQUIRE(h.machine.State("j2").ok());
  REQUIRE(h.State("j2").members_size() == 0);
  h.Advance(absl::Hours(1));
  REQUIRE_CODE(h.machine.State("j2"), absl::StatusCode::kNotFound);
}

TEST_CASE("only the last 32 failures are kept") {
  Harness h;
  auto config = Config(1, 1, 0, /*max_restarts=*/100);
  std::string a = h.Join("j1", config);
  for (int round = 0; round < 40; ++round) {
    REQUIRE(h.State("j1").phase() == pb::RUNNING);
    REQUIRE_OK(h.ReportFailure("j1", round, a, /*exit_code=*/round));
    h.Rejoin("j1", config, a);
  }
  pb::JobState state = h.State("j1");
  REQUIRE(state.restart_count() == 40);
  REQUIRE(state.failures_size() == 32);
  REQUIRE(state.failures(0).exit_code() == 8);
  REQUIRE(state.failures(31).exit_code() == 39);
}

TEST_CASE("a requested rank is free again once its member is gone") {
  Harness h;
  auto config = Config(2, 2);
  JoinArgs wants1;
  wants1.requested_rank = 1;
  std::string a = h.Join("j1", config, wants1);
  REQUIRE_CODE(h.TryJoin("j1", config, wants1), absl::StatusCode::kFailedPrecondition);
  REQUIRE_OK(h.Leave("j1", a));
  h.Join("j1", config, wants1);
  REQUIRE(h.State("j1").nodes_pending() == 1);
}

TEST_CASE("calls naming another round are fenced and change nothing") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  REQUIRE_OK(h.ReportFailure("j1", 0, a));
  h.Rejoin("j1", config, a);
  h.Rejoin("j1", config, b);
  REQUIRE(h.State("j1").round() == 1);
  REQUIRE_OK(h.Set("j1", 1, "k", "v"));
  h.machine.TakeDirty();
  h.machine.TakeChangedJobs();

  std::string before = h.machine.Snapshot(h.now).SerializeAsString();
  pb::JobState state_before = h.State("j1");
  auto stale = h.ReportDone("j1", 0, a);
  REQUIRE_CODE(stale, absl::StatusCode::kAborted);
  REQUIRE(std::string(stale.status().message()) ==
          "round 0 of job j1 is over; the current round is 1");
  REQUIRE_CODE(h.ReportFailure("j1", 0, b), absl::StatusCode::kAborted);
  REQUIRE_CODE(h.Set("j1", 0, "k", "old"), absl::StatusCode::kAborted);
  REQUIRE_CODE(h.machine.Get("j1", 0, "k"), absl::StatusCode::kAborted);
  REQUIRE_CODE(h.ReportDone("j1", 2, a), absl::StatusCode::kFailedPrecondition);
  REQUIRE_CODE(h.Set("j1", 2, "k", "new"), absl::StatusCode::kFailedPrecondition);
  REQUIRE_CODE(h.ReportDone("j1", 1, "stranger"), absl::StatusCode::kFailedPrecondition);
  REQUIRE_CODE(h.ReportFailure("nope", 1, a), absl::StatusCode::kNotFound);
  REQUIRE(h.machine.Snapshot(h.now).SerializeAsString() == before);
  REQUIRE(h.State("j1").SerializeAsString() == state_before.SerializeAsString());
  REQUIRE_FALSE(h.machine.TakeDirty());
  REQUIRE(h.machine.TakeChangedJobs().empty());
  REQUIRE(*h.machine.Get("j1", 1, "k") == "v");

  // While a round gathers, its store and reports are not open yet.
  REQUIRE_OK(h.ReportFailure("j1", 1, a));
  REQUIRE_CODE(h.Set("j1", 2, "k", "v"), absl::StatusCode::kFailedPrecondition);
  REQUIRE_CODE(h.ReportDone("j1", 2, a), absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a join whose settings differ names the setting") {
  Harness h;
  h.Join("j1", Config(2, 4));
  auto conflict = h.TryJoin("j1", Config(3, 4));
  REQUIRE_CODE(conflict, absl::StatusCode::kFailedPrecondition);
  REQUIRE(std::string(conflict.status().message()) ==
          "job \"j1\": min_nodes is 2 but this join asks for 3");
  auto other = Config(2, 4);
  other.set_lease_ttl_ms(5000);
  auto ttl_conflict = h.TryJoin("j1", other);
  REQUIRE_THAT(std::string(ttl_conflict.status().message()),
               Catch::Contains("lease_ttl_ms is 10000"));
  REQUIRE(h.State("j1").nodes_pending() == 1);
}

TEST_CASE("requests are validated") {
  Harness h;
  auto config = Config(1, 2);
  for (const std::string& bad :
       std::vector<std::string>{"", "a b", "a/b", "tab\t", "caf\xc3\xa9", std::string(300, 'x')}) {
    REQUIRE_CODE(h.TryJoin(bad, config), absl::StatusCode::kInvalidArgument);
  }
  JoinArgs args;
  args.member_id = "bad id";
  REQUIRE_CODE(h.TryJoin("j1", config, args), absl::StatusCode::kInvalidArgument);
  auto short_lease = config;
  short_lease.set_lease_ttl_ms(50);
  REQUIRE_CODE(h.TryJoin("j1", short_lease), absl::StatusCode::kInvalidArgument);
  REQUIRE_CODE(h.TryJoin("j1", Config(3, 2)), absl::StatusCode::kInvalidArgument);
  REQUIRE_CODE(h.TryJoin("j1", Config(0, 2)), absl::StatusCode::kInvalidArgument);
  auto no_timeout = config;
  no_timeout.set_join_timeout_ms(0);
  REQUIRE_CODE(h.TryJoin("j1", no_timeout), absl::StatusCode::kInvalidArgument);
  args = JoinArgs();
  args.nproc = 0;
  REQUIRE_CODE(h.TryJoin("j1", config, args), absl::StatusCode::kInvalidArgument);
  auto no_address = h.JoinRequest("j1", config);
  no_address.set_address("");
  REQUIRE_CODE(h.machine.Join(no_address, "", h.now), absl::StatusCode::kInvalidArgument);
  REQUIRE(h.machine.job_count() == 0);
  // A member id the job does not know: the lease may have expired.
  args = JoinArgs();
  args.member_id = "ghost-1";
  REQUIRE_CODE(h.TryJoin("j1", config, args), absl::StatusCode::kNotFound);
  h.Join("j1", config);
  REQUIRE_CODE(h.TryJoin("j1", config, args), absl::StatusCode::kNotFound);
  REQUIRE_CODE(h.KeepAlive("j1", "ghost-1"), absl::StatusCode::kNotFound);
  REQUIRE_CODE(h.KeepAlive("j2", "ghost-1"), absl::StatusCode::kNotFound);
}

TEST_CASE("a closed job refuses joins until retention drops it") {
  Harness h;
  auto config = Config(1, 2);
  std::string a = h.Join("j1", config);
  pb::CloseJobRequest close;
  close.set_job_id("j1");
  close.set_reason("maintenance");
  auto closed = h.machine.Close(close, h.now);
  REQUIRE_OK(closed);
  REQUIRE(closed->phase() == pb::CLOSED);
  REQUIRE(closed->status_message() == "maintenance");
  h.Check();
  auto join = h.TryJoin("j1", config);
  REQUIRE_CODE(join, absl::StatusCode::kFailedPrecondition);
  REQUIRE_THAT(std::string(join.status().message()),
               Catch::Contains("job \"j1\" is closed (closed at round 0: "
                               "maintenance)"));
  REQUIRE_CODE(h.KeepAlive("j1", a), absl::StatusCode::kFailedPrecondition);
  // Finished jobs hold no leases.
  h.Advance(kTtl * 2);
  REQUIRE(h.machine.job_count() == 1);
  h.machine.TakeChangedJobs();
  h.Advance(Limits().closed_retention - kTtl * 2 - absl::Milliseconds(1));
  REQUIRE(h.machine.job_count() == 1);
  h.Advance(absl::Milliseconds(1));
  REQUIRE(h.machine.job_count() == 0);
  REQUIRE(h.machine.member_count() == 0);
  REQUIRE(h.machine.TakeChangedJobs() == std::vector<std::string>{"j1"});
  REQUIRE_CODE(h.machine.State("j1"), absl::StatusCode::kNotFound);
  REQUIRE(h.machine.NextDeadline() == absl::InfiniteFuture());
  // The id is free again.
  h.Join("j1", config);
  REQUIRE(h.State("j1").round() == 0);

  close.set_reason("");
  auto by_admin = h.machine.Close(close, h.now);
  REQUIRE(by_admin->status_message() == "closed by administrator");
  REQUIRE_CODE(h.machine.Close(close, h.now), absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("requested ranks are honoured where they fit") {
  Harness h;
  auto config = Config(3, 3);
  JoinArgs wants2, wants0, wants_any;
  wants2.requested_rank = 2;
  wants0.requested_rank = 0;
  std::string a = h.Join("j1", config, wants2);
  JoinArgs clash;
  clash.requested_rank = 2;
  REQUIRE_CODE(h.TryJoin("j1", config, clash), absl::StatusCode::kFailedPrecondition);
  JoinArgs too_big;
  too_big.requested_rank = 3;
  REQUIRE_CODE(h.TryJoin("j1", config, too_big), absl::StatusCode::kInvalidArgument);
  std::string b = h.Join("j1", config, wants0);
  std::string c = h.Join("j1", config, wants_any);
  REQUIRE(h.RankOrder("j1") == std::vector<std::string>{b, c, a});

  // Holes are compacted: rank 3 does not fit a world of 2.
  auto elastic = Config(2, 4);
  JoinArgs wants3, wants1;
  wants3.requested_rank = 3;
  wants1.requested_rank = 1;
  std::string d = h.Join("j2", elastic, wants3);
  std::string e = h.Join("j2", elastic, wants1);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.RankOrder("j2") == std::vector<std::string>{d, e});
}

TEST_CASE("rank offsets are prefix sums of nproc") {
  Harness h;
  auto config = Config(3, 3);
  for (uint32_t nproc : {4u, 2u, 8u}) {
    JoinArgs args;
    args.nproc = nproc;
    h.Join("j1", config, args);
  }
  pb::JobState state = h.State("j1");
  REQUIRE(state.world_size() == 14);
  REQUIRE(state.members(0).rank_offset() == 0);
  REQUIRE(state.members(1).rank_offset() == 4);
  REQUIRE(state.members(2).rank_offset() == 6);
  REQUIRE(state.members(2).group_rank() == 2);
}

TEST_CASE("every member reporting done succeeds the job") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  auto done = h.ReportDone("j1", 0, a);
  REQUIRE_OK(done);
  REQUIRE(done->nodes_done() == 1);
  REQUIRE(done->phase() == pb::RUNNING);
  // a may exit now: its silence does not end the round.
  for (int i = 0; i < 6; ++i) {
    h.Advance(kTtl / 3);
    REQUIRE_OK(h.KeepAlive("j1", b));
  }
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.ReportDone("j1", 0, b));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::SUCCEEDED);
  REQUIRE(state.nodes_done() == 2);
  REQUIRE(state.members_size() == 2);
  auto join = h.TryJoin("j1", config);
  REQUIRE_THAT(std::string(join.status().message()),
               Catch::Contains("is closed (succeeded at round 0)"));
}

TEST_CASE("leaving ends the round without a restart") {
  Harness h;
  auto config = Config(1, 3, /*last_call_ms=*/0);
  std::string a = h.Join("j1", config);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  std::string b = h.Join("j1", config);  // waiting
  REQUIRE_OK(h.Leave("j1", b));
  REQUIRE(h.State("j1").nodes_waiting() == 0);
  REQUIRE_OK(h.Leave("j1", a));
  pb::JobState state = h.State("j1");
  REQUIRE(state.phase() == pb::GATHERING);
  REQUIRE(state.last_end_reason() == pb::MEMBER_LEFT);
  REQUIRE(state.restart_count() == 0);
  REQUIRE(h.machine.member_count() == 0);
  REQUIRE_CODE(h.Leave("j1", a), absl::StatusCode::kNotFound);
}

TEST_CASE("versions, dirtiness and change notifications") {
  Harness h;
  auto config = Config(2, 2);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  REQUIRE(h.machine.TakeDirty());
  REQUIRE(h.machine.TakeChangedJobs() == std::vector<std::string>{"j1"});
  uint64_t version = h.State("j1").version();
  h.Advance(absl::Seconds(1));
  auto renewed = h.KeepAlive("j1", a);
  REQUIRE_OK(renewed);
  REQUIRE(renewed->version() == version);
  REQUIRE(renewed->lease_ttl_ms() == 10'000);
  REQUIRE_FALSE(h.machine.TakeDirty());
  REQUIRE(h.machine.TakeChangedJobs().empty());
  REQUIRE_OK(h.Set("j1", 0, "k", "v"));
  REQUIRE(h.State("j1").version() == version);
  REQUIRE(h.machine.TakeDirty());
  REQUIRE(h.machine.TakeChangedJobs() == std::vector<std::string>{"j1"});
  REQUIRE_OK(h.ReportDone("j1", 0, b));
  REQUIRE(h.State("j1").version() > version);
}

TEST_CASE("Snapshot and Restore reproduce every job and extend leases") {
  Harness h;
  auto config = Config(2, 3);
  // j-run: RUNNING round 1 with a store, a failure and a waiting node.
  std::string a = h.Join("j-run", config);
  std::string b = h.Join("j-run", config, JoinArgs{"", "gpu7", 4, 1, ""});
  h.Advance(absl::Seconds(1));
  REQUIRE_OK(h.ReportFailure("j-run", 0, a));
  h.Rejoin("j-run", config, a);
  JoinArgs rejoin_b{b, "gpu7", 4, 1, ""};
  h.Join("j-run", config, rejoin_b);
  REQUIRE(h.State("j-run").phase() == pb::RUNNING);
  REQUIRE_OK(h.Set("j-run", 1, "MASTER_ADDR", "10.0.0.1:29500"));
  std::string c = h.Join("j-run", config);
  REQUIRE(h.State("j-run").phase() == pb::RUNNING);
  REQUIRE_OK(h.ReportDone("j-run", 1, a));
  // j-gather: one pending node, and a secret. j-failed: a failed job.
  h.Join("j-gather", config, JoinArgs{"", "host", 1, -1, "pw"});
  auto short_timeout = Config(5, 5);
  short_timeout.set_join_timeout_ms(1000);
  h.Join("j-failed", short_timeout);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.State("j-failed").phase() == pb::FAILED);
  REQUIRE_OK(h.KeepAlive("j-run", b));
  REQUIRE_OK(h.KeepAlive("j-run", c));

  state::ServerState snapshot = h.machine.Snapshot(h.now);
  std::string bytes = snapshot.SerializeAsString();
  state::ServerState parsed;
  REQUIRE(parsed.ParseFromString(bytes));

  Harness restored;
  restored.now = h.now + absl::Hours(5);  // another process, another clock
  REQUIRE_OK(restored.machine.Restore(parsed, restored.now));
  restored.Check();
  REQUIRE(restored.machine.job_count() == 3);
  REQUIRE(restored.machine.member_count() == h.machine.member_count());
  for (const char* job : {"j-run", "j-gather", "j-failed"}) {
    INFO(job);
    REQUIRE(restored.State(job).SerializeAsString() == h.State(job).SerializeAsString());
  }
  REQUIRE(*restored.machine.Get("j-run", 1, "MASTER_ADDR") == "10.0.0.1:29500");
  REQUIRE_OK(restored.machine.Authorize("j-gather", "pw"));
  REQUIRE_CODE(restored.machine.Authorize("j-gather", "wrong"),
               absl::StatusCode::kPermissionDenied);
  REQUIRE(restored.machine.Snapshot(restored.now).SerializeAsString() == bytes);
  // Every lease runs a full ttl from the restore.
  REQUIRE(restored.machine.NextDeadline() == restored.now + kTtl);
  restored.Advance(kTtl - absl::Milliseconds(1));
  REQUIRE(restored.State("j-run").phase() == pb::RUNNING);
  REQUIRE(restored.machine.member_count() == h.machine.member_count());
  restored.Advance(absl::Milliseconds(1));
  REQUIRE(restored.State("j-run").phase() == pb::GATHERING);
  // a reported done, so only b's lapse counts, once.
  REQUIRE(restored.State("j-run").restart_count() == 2);

  REQUIRE_CODE(restored.machine.Restore(parsed, restored.now),
               absl::StatusCode::kFailedPrecondition);
  state::ServerState broken = parsed;
  broken.mutable_jobs(0)->add_round_members("nobody");
  StateMachine fresh;
  REQUIRE_CODE(fresh.Restore(broken, restored.now), absl::StatusCode::kDataLoss);
  REQUIRE(fresh.job_count() == 0);
  broken = parsed;
  broken.mutable_jobs(0)->mutable_config()->set_min_nodes(0);
  REQUIRE_CODE(fresh.Restore(broken, restored.now), absl::StatusCode::kDataLoss);
  broken = parsed;
  broken.set_format_version(7);
  REQUIRE_CODE(fresh.Restore(broken, restored.now), absl::StatusCode::kDataLoss);
  REQUIRE_OK(fresh.Restore(state::ServerState(), restored.now));
  REQUIRE(fresh.job_count() == 0);
  REQUIRE_OK(fresh.Restore(parsed, restored.now));
  REQUIRE(fresh.job_count() == 3);
}

TEST_CASE("join_timeout_ms of a new job is bounded") {
  Limits limits;
  limits.max_join_timeout_ms = 60'000;
  Harness h(limits);
  for (int64_t timeout : {int64_t{60'001}, int64_t{1} << 40, std::numeric_limits<int64_t>::max()}) {
    INFO(timeout);
    auto config = Config(2, 2);
    config.set_join_timeout_ms(timeout);
    auto refused = h.TryJoin("j1", config);
    REQUIRE_CODE(refused, absl::StatusCode::kInvalidArgument);
    std::string message(refused.status().message());
    CHECK(message.find("join_timeout_ms") != std::string::npos);
    CHECK(message.find("60000") != std::string::npos);
    CHECK(message.find("--max-join-timeout-ms") != std::string::npos);
  }
  REQUIRE(h.machine.job_count() == 0);
  auto config = Config(2, 2);
  config.set_join_timeout_ms(60'000);
  h.Join("j1", config);
  REQUIRE(h.machine.job_count() == 1);
}

TEST_CASE("a 1000-member job joins and closes quickly") {
  Harness h;
  auto config = Config(1000, 1000);
  auto start = std::chrono::steady_clock::now();
  std::vector<std::string> ids;
  for (int i = 0; i < 1000; ++i) {
    auto response = h.machine.Join(h.JoinRequest("big", config), "", h.now);
    REQUIRE(response.ok());
    ids.push_back(response->member_id());
  }
  h.Check();
  REQUIRE(h.State("big").phase() == pb::RUNNING);
  REQUIRE(h.State("big").world_size() == 1000);
  // 20,000 renewals with a Tick after each 100, as the service would do.
  for (int i = 0; i < 20'000; ++i) {
    if (i % 1000 == 0) h.now += absl::Milliseconds(100);
    pb::KeepAliveRequest request;
    request.set_job_id("big");
    request.set_member_id(ids[i % ids.size()]);
    REQUIRE(h.machine.KeepAlive(request, h.now).ok());
    if (i % 100 == 0) h.machine.Tick(h.now);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  h.Check();
  INFO("seconds: " << seconds);
  REQUIRE(seconds < 1.0);
}

}  // namespace
}  // namespace muster::rdzv
