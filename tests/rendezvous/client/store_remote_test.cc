// RemoteStore against an in-process server: the Store contract over gRPC,
// and fencing by (job, round).
#include <thread>

#include <catch2/catch.hpp>

#include "rendezvous/client/client.h"
#include "rendezvous/client/store.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

TEST_CASE("RemoteStore works against the server", "[client][store]") {
  auto server = testing::StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  auto joined =
      JoinAndWaitForRound(*client, testing::JoinRequestFor("kv", testing::Config(1, 1, 5000), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(joined.ok());
  const uint64_t round = joined->state.round();
  RemoteStore store(client.get(), "kv", round);

  REQUIRE(store.Set("addr", "10.0.0.1:29500").ok());
  CHECK(*store.Get("addr", absl::ZeroDuration()) == "10.0.0.1:29500");
  CHECK(store.Get("absent", absl::ZeroDuration()).status().code() == absl::StatusCode::kNotFound);
  CHECK(store.Get("absent", absl::Milliseconds(100)).status().code() ==
        absl::StatusCode::kDeadlineExceeded);

  CHECK(*store.Add("count", 2) == 2);
  CHECK(*store.Add("count", 3) == 5);

  auto won = store.CompareAndSet("leader", std::nullopt, "node0");
  REQUIRE(won.ok());
  CHECK(won->swapped);
  auto lost = store.CompareAndSet("leader", std::nullopt, "node1");
  REQUIRE(lost.ok());
  CHECK_FALSE(lost->swapped);
  CHECK(lost->value == "node0");

  CHECK(*store.Delete("leader"));
  CHECK_FALSE(*store.Delete("leader"));

  // A blocked Get is woken by a Set from another client.
  auto other_client = testing::ConnectTo(server->port());
  RemoteStore other(other_client.get(), "kv", round);
  absl::Status set_status;
  std::thread setter([&] {
    // Wait until the getter is blocked server-side is not observable; the
    // Get's long wait covers either order.
    set_status = other.Set("late", "value");
  });
  auto late = store.Get("late", absl::Seconds(10));
  setter.join();
  CHECK(set_status.ok());
  REQUIRE(late.ok());
  CHECK(*late == "value");
  CHECK(store.Wait({"addr", "late"}, absl::Seconds(5)).ok());
  CHECK(store.Wait({"addr", "never"}, absl::Milliseconds(100)).code() ==
        absl::StatusCode::kDeadlineExceeded);

  // Prefix scoping composes with the remote store.
  PrefixStore group(&store, "pg0");
  REQUIRE(group.Set("rank0", "x").ok());
  CHECK(*store.Get("pg0/rank0", absl::ZeroDuration()) == "x");

  // Once the round ends its keys are gone and the old round is fenced off.
  pb::ReportFailureRequest failure;
  failure.set_job_id("kv");
  failure.set_round(round);
  failure.set_member_id(joined->member_id);
  failure.set_exit_code(1);
  REQUIRE(client->ReportFailure(failure).ok());
  CHECK(store.Set("addr", "stale").code() == absl::StatusCode::kAborted);
  CHECK(store.Get("addr", absl::ZeroDuration()).status().code() == absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace muster::rdzv
