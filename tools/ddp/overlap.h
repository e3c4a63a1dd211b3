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
#include "parallel/bootstrap.h"
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

// DDP with a world of one against no strategy at all, on config.device
// (CPU, or CUDA device 0): what the reducer costs a step when there is no
// peer, so every reduction is the back end's fixed cost (NCCL: launches and
// a copy; Gloo staged through pinned memory: device-to-host and back).
// Two Trainers in this process, one plain and one with worker::Ddp over a
// `backend` group of one rank (its control group a Gloo group of one),
// take `steps` steps each in turn for `rounds` rounds (which goes first
// alternates), after `warmup` untimed steps each. Then the Ddp model's
// buckets are reduced bare, `steps` times, each after the device has
// finished its queued work.
//   overhead = ddp_ms - single_ms     (what DDP added to a step)
//   hidden   = 1 - overhead / bare_ms (the part of the reduction the step
//                                      did not pay; below 0 when DDP costs
//                                      a step more than its reductions)
// Step times are host times around Trainer::Step, medians over all
// rounds; a step reads its loss back, so its kernels are done when the
// next one starts, up to the optimizer's.
struct WorldOfOneFigures {
  int buckets = 0;
  size_t gradient_floats = 0;
  double single_ms = 0;
  double ddp_ms = 0;
  double bare_ms = 0;
  double overhead_ms = 0;
  double hidden = 0;
};

// `config` must name training data; its model, micro-batch, precision and
// parallel.bucket_mb are used. `backend`: kGloo, or on CUDA kNccl or
// kStagedGloo (FAILED_PRECONDITION from the group in a build without CUDA).
absl::StatusOr<WorldOfOneFigures> MeasureWorldOfOne(const worker::TrainConfig& config,
                                                    parallel::DataBackend backend, int warmup,
                                                    int steps, int rounds);

}  // namespace muster::tools
