// Time for the server. The rendezvous server owns time:
// leases are measured on its monotonic clock, never on a client's wall clock.
#pragma once

#include <chrono>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muster::rdzv {

// A monotonic clock. Its instants are only meaningful relative to each
// other within one process.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

// steady_clock, expressed as absl::Time so durations compose with absl.
class MonotonicClock : public Clock {
 public:
  absl::Time Now() override {
    auto since_boot = std::chrono::steady_clock::now().time_since_epoch();
    return absl::UnixEpoch() + absl::FromChrono(since_boot);
  }
  static MonotonicClock* Default() {
    static MonotonicClock clock;
    return &clock;
  }
};

// A clock tests move by hand. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}
  absl::Time Now() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration by) {
    absl::MutexLock lock(&mu_);
    now_ += by;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::rdzv
