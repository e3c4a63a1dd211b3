// The pauses between polls of something that finishes on its own: a CUDA
// event, a copy on a stream, a non-blocking NCCL communicator's state.
//
// A fixed sleep costs every operation up to that sleep (and the kernel's
// timer slack, 50 us by default) after it has finished. On a GPU most
// collectives of a step take tens of microseconds, so a fixed 200 us sleep
// was most of their time: 13 back-to-back parameter gathers of FSDP at
// ZeRO-2 cost 3.4 ms a step on an H200, where the copies take 0.3 ms. So:
// yield for a short spin first, which sees a short operation end within a
// few microseconds, then sleep, doubling from a first pause to a longest,
// which bounds both the wake-ups of a long operation and its added latency.
//
// Our own, a few lines: absl's spin-wait backoff is internal to absl, and
// what is polled here is no lock.
#pragma once

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace muster::parallel {

class PollBackoff {
 public:
  PollBackoff(absl::Duration spin, absl::Duration first_sleep, absl::Duration longest_sleep)
      : spin_until_(absl::Now() + spin),
        next_(std::max(first_sleep, absl::ZeroDuration())),
        longest_(std::max(longest_sleep, next_)) {}

  // One pause: a yield while within the spin (returns zero), else a sleep
  // (returns its length, each one twice the last, up to the longest).
  absl::Duration Pause() {
    if (absl::Now() < spin_until_) {
      std::this_thread::yield();
      return absl::ZeroDuration();
    }
    const absl::Duration pause = next_;
    absl::SleepFor(pause);
    next_ = std::min(next_ * 2, longest_);
    return pause;
  }

 private:
  const absl::Time spin_until_;
  absl::Duration next_;
  const absl::Duration longest_;
};

}  // namespace muster::parallel
