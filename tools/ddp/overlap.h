// How much of DDP's gradient allreduce the backward pass hides, measured
// inside the real training step: `ranks` threads of this process each run
// a worker::Trainer with the worker::Ddp strategy over a Gloo group, and
// after each step read GradientReducer::last_exposed_wait(), the time the
// step blocked in Finish waiting for communication.
//
// The reference is the same reducer (same buckets, same group) reducing
// with nothing else running: Arm, then Finish at once, which issues every
// bucket and waits. hidden = 1 - exposed / bare, medians over steps.
//
// Skew: a rank that finishes backward early also waits for its peers to
// get there. That is load imbalance, not communication, so each step's
// exposed wait (and each bare reduction) is the one of the rank that
// started waiting last; the skew is reported on its own. Threads share one
// clock, which makes this exact.
//
// Caveat: on a CPU the reduction (memcpy, sums, loopback TCP) needs cores
// too, so while it overlaps backward it also slows backward down; that
// cost shows in the step time, not in `hidden` (compare the scaling
// figures).
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "worker/config/config.h"

namespace muster::tools {

struct OverlapFigures {
  int buckets = 0;
  size_t gradient_floats = 0;
  // Medians over timed steps.
  double step_ms = 0;     // DDP step (forward, backward, reduce, AdamW), all ranks
  double exposed_ms = 0;  // last_exposed_wait of the last rank to end backward
  double skew_ms = 0;     // last rank's end of backward - first rank's
  double bare_ms = 0;     // the bare reduction of all buckets, last rank to start
  double hidden = 0;      // 1 - exposed_ms / bare_ms
};

// `config` must name training data; its parallel.bucket_mb is used.
// `warmup` steps are run first and not counted.
absl::StatusOr<OverlapFigures> MeasureOverlap(const worker::TrainConfig& config, int ranks,
                                              int warmup, int steps);

}  // namespace muster::tools
