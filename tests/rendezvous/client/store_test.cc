// InMemoryStore and PrefixStore semantics (rendezvous/client/store.h).
#include "rendezvous/client/store.h"

#include <atomic>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace muster::rdzv {
namespace {

TEST_CASE("InMemoryStore Set then Get returns the value", "[store]") {
  InMemoryStore store;
  REQUIRE(store.Set("a", "1").ok());
  REQUIRE(store.Set("a", "2").ok());
  auto value = store.Get("a", absl::ZeroDuration());
  REQUIRE(value.ok());
  CHECK(*value == "2");
}

TEST_CASE("InMemoryStore Get with zero timeout is NOT_FOUND when absent", "[store]") {
  InMemoryStore store;
  auto value = store.Get("missing", absl::ZeroDuration());
  CHECK(value.status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("InMemoryStore Get times out with DEADLINE_EXCEEDED", "[store]") {
  InMemoryStore store;
  const absl::Time start = absl::Now();
  auto value = store.Get("missing", absl::Milliseconds(50));
  CHECK(value.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::Now() - start >= absl::Milliseconds(50));
  CHECK(absl::Now() - start < absl::Seconds(5));
}

TEST_CASE("InMemoryStore blocking Get is woken by a Set from another thread", "[store]") {
  InMemoryStore store;
  absl::Notification getter_started;
  absl::StatusOr<std::string> result;
  std::thread getter([&] {
    getter_started.Notify();
    result = store.Get("key", absl::Seconds(10));
  });
  REQUIRE(getter_started.WaitForNotificationWithTimeout(absl::Seconds(5)));
  const absl::Time set_at = absl::Now();
  REQUIRE(store.Set("key", "value").ok());
  getter.join();
  REQUIRE(result.ok());
  CHECK(*result == "value");
  CHECK(absl::Now() - set_at < absl::Seconds(5));  // woken, not timed out
}

TEST_CASE("InMemoryStore Wait returns when every key exists", "[store]") {
  InMemoryStore store;
  REQUIRE(store.Set("x", "").ok());
  // Catch2 assertions are not thread-safe: threads only record results.
  absl::Status write;
  std::thread writer([&] { write = store.Set("y", ""); });
  CHECK(store.Wait({"x", "y"}, absl::Seconds(10)).ok());
  writer.join();
  CHECK(write.ok());
}

TEST_CASE("InMemoryStore Wait times out naming the missing key", "[store]") {
  InMemoryStore store;
  REQUIRE(store.Set("x", "").ok());
  absl::Status status = store.Wait({"x", "nope"}, absl::Milliseconds(30));
  CHECK(status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::string(status.message()).find("nope") != std::string::npos);
}

TEST_CASE("InMemoryStore Add counts from zero and is atomic", "[store]") {
  InMemoryStore store;
  auto first = store.Add("counter", 5);
  REQUIRE(first.ok());
  CHECK(*first == 5);
  constexpr int kThreads = 8, kAddsEach = 500;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kAddsEach; ++i) {
        if (!store.Add("counter", 1).ok()) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(failures == 0);
  auto total = store.Get("counter", absl::ZeroDuration());
  REQUIRE(total.ok());
  CHECK(*total == std::to_string(5 + kThreads * kAddsEach));
  CHECK(*store.Add("counter", -5) == kThreads * kAddsEach);
}

TEST_CASE("InMemoryStore Add rejects a non-integer value", "[store]") {
  InMemoryStore store;
  REQUIRE(store.Set("word", "hello").ok());
  CHECK(store.Add("word", 1).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("InMemoryStore CompareAndSet swaps only on a match", "[store]") {
  InMemoryStore store;
  auto absent = store.CompareAndSet("k", std::nullopt, "v1");
  REQUIRE(absent.ok());
  CHECK(absent->swapped);
  CHECK(absent->value == "v1");

  auto again = store.CompareAndSet("k", std::nullopt, "v2");
  REQUIRE(again.ok());
  CHECK_FALSE(again->swapped);
  CHECK(again->present);
  CHECK(again->value == "v1");

  auto wrong = store.CompareAndSet("k", std::string("other"), "v3");
  REQUIRE(wrong.ok());
  CHECK_FALSE(wrong->swapped);
  CHECK(wrong->value == "v1");

  auto right = store.CompareAndSet("k", std::string("v1"), "v4");
  REQUIRE(right.ok());
  CHECK(right->swapped);
  CHECK(*store.Get("k", absl::ZeroDuration()) == "v4");

  auto missing = store.CompareAndSet("none", std::string("x"), "y");
  REQUIRE(missing.ok());
  CHECK_FALSE(missing->swapped);
  CHECK_FALSE(missing->present);
}

TEST_CASE("InMemoryStore CompareAndSet elects exactly one winner", "[store]") {
  InMemoryStore store;
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto result = store.CompareAndSet("leader", std::nullopt, std::to_string(t));
      if (result.ok() && result->swapped) ++winners;
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(winners == 1);
}

TEST_CASE("InMemoryStore Delete reports whether the key existed", "[store]") {
  InMemoryStore store;
  REQUIRE(store.Set("k", "v").ok());
  CHECK(*store.Delete("k") == true);
  CHECK(*store.Delete("k") == false);
  CHECK(store.Get("k", absl::ZeroDuration()).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("PrefixStore scopes every key under its prefix", "[store]") {
  InMemoryStore base;
  PrefixStore group_a(&base, "a");
  PrefixStore group_b(&base, "b");
  REQUIRE(group_a.Set("k", "from a").ok());
  REQUIRE(group_b.Set("k", "from b").ok());
  CHECK(*group_a.Get("k", absl::ZeroDuration()) == "from a");
  CHECK(*group_b.Get("k", absl::ZeroDuration()) == "from b");
  CHECK(*base.Get("a/k", absl::ZeroDuration()) == "from a");

  CHECK(*group_a.Add("n", 3) == 3);
  CHECK(*base.Get("a/n", absl::ZeroDuration()) == "3");
  CHECK(group_b.Get("n", absl::ZeroDuration()).status().code() == absl::StatusCode::kNotFound);

  auto cas = group_b.CompareAndSet("k", std::string("from b"), "new");
  REQUIRE(cas.ok());
  CHECK(cas->swapped);
  CHECK(*base.Get("b/k", absl::ZeroDuration()) == "new");

  CHECK(*group_a.Delete("k"));
  CHECK(base.Get("a/k", absl::ZeroDuration()).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("PrefixStore Wait and blocking Get see the base's writes", "[store]") {
  InMemoryStore base;
  PrefixStore scoped(&base, "job/3");
  absl::Status write_x, write_y;
  std::thread writer([&] {
    write_x = base.Set("job/3/x", "1");
    write_y = base.Set("job/3/y", "2");
  });
  CHECK(scoped.Wait({"x", "y"}, absl::Seconds(10)).ok());
  auto value = scoped.Get("y", absl::Seconds(10));
  writer.join();
  CHECK((write_x.ok() && write_y.ok()));
  REQUIRE(value.ok());
  CHECK(*value == "2");
  CHECK(scoped.Wait({"z"}, absl::Milliseconds(20)).code() == absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace muster::rdzv
