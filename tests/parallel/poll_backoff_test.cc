// PollBackoff: yields through its spin, then sleeps, doubling to a cap.
#include "parallel/poll_backoff.h"

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace muster::parallel {
namespace {

TEST_CASE("PollBackoff sleeps from its first pause, doubling, up to its longest") {
  PollBackoff backoff(absl::ZeroDuration(), absl::Microseconds(20), absl::Microseconds(100));
  CHECK(backoff.Pause() == absl::Microseconds(20));
  CHECK(backoff.Pause() == absl::Microseconds(40));
  CHECK(backoff.Pause() == absl::Microseconds(80));
  CHECK(backoff.Pause() == absl::Microseconds(100));
  CHECK(backoff.Pause() == absl::Microseconds(100));
}

TEST_CASE("PollBackoff only yields within its spin, then sleeps") {
  const absl::Duration spin = absl::Milliseconds(20);
  const absl::Time start = absl::Now();
  PollBackoff backoff(spin, absl::Microseconds(50), absl::Microseconds(50));
  int yields = 0;
  absl::Duration slept;
  // Bounded: the spin ends 20 ms after construction.
  while ((slept = backoff.Pause()) == absl::ZeroDuration()) ++yields;
  const absl::Duration took = absl::Now() - start;
  CHECK(yields > 0);
  CHECK(slept == absl::Microseconds(50));
  CHECK(took >= spin);
  // The first sleep comes right after the spin, not a pause later.
  CHECK(took < spin + absl::Seconds(1));
}

TEST_CASE("PollBackoff's longest pause is never below its first") {
  PollBackoff backoff(absl::ZeroDuration(), absl::Microseconds(30), absl::Microseconds(10));
  CHECK(backoff.Pause() == absl::Microseconds(30));
  CHECK(backoff.Pause() == absl::Microseconds(30));
}

}  // namespace
}  // namespace muster::parallel
