// One training job of tools/bench_fsdp with ranks as threads of this
// process: each rank a real worker::Trainer over real Gloo groups (joined
// through an in-memory store, parallel/local_ranks.h): a data group for the
// strategy, the worker::Ddp strategy or worker::Fsdp at ZeRO-1, 2 or 3, and
// a control group of its own (the loss and the stop vote), as in the worker.
//
// Throughput: global tokens over the wall time of the timed steps (the
// slowest rank's; the step's loss all-reduce keeps the ranks in step).
//
// Communication hidden behind compute (the waits also for DDP, whose bucket
// all-reduces are timed the same way; `alone` and `hidden` FSDP only):
//   exposed  Fsdp::waits() gather_s + reduce_s added during one step: the
//            time the training thread blocked on the step's all-gathers
//            and reduce-scatters. Per step, the mean over ranks (what a
//            step lost) and the least rank's (a rank that reaches a
//            collective first also waits for its peer to get there: skew,
//            not communication); medians over the timed steps.
//   alone    the same collectives on the same sizes with nothing else
//            running: the shard group is wrapped to record every
//            AllGather and ReduceScatter Fsdp issues during the last timed
//            step, in order; after training they are issued again, back to
//            back over the same group, and waited for. The rank that left
//            the barrier before them last (the least time), median of
//            `replays` after two untimed (the first rounds are 3-4x
//            slower: fresh scratch memory). (The gradient norm's
//            all-gather goes over the control group, so it is in neither.)
//   hidden = 1 - exposed / alone.
//   peers there  exposed split: each wait counted only from the moment
//            every rank had issued the collective (ranks are threads, so
//            their clocks agree); the part before is the rank waiting for
//            a peer to reach the collective (skew, load imbalance), which
//            no overlap can hide. Mean over ranks, median over steps.
//
// Caveat: on a CPU the communication thread needs a core too, so while it
// overlaps compute it slows compute; that shows in tokens/s, not in
// `hidden`.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "worker/config/config.h"
#include "worker/strategy/fsdp/fsdp.h"

namespace muster::tools {

struct ThreadsRun {
  double tokens_per_s = 0;  // global
  double ms_per_step = 0;
  // Per step (DDP: the waits on its buckets' all-reduces):
  double exposed_ms = 0;        // mean over ranks
  double exposed_least_ms = 0;  // the least rank's
  // The mean over ranks of the waits from the moment every rank had issued
  // the collective: exposed less the time spent waiting for a peer to
  // arrive (-1 if the ranks' collectives did not line up).
  double exposed_arrived_ms = 0;
  std::vector<double> exposed_rank_ms;  // each rank's median
  // FSDP only (zero > 0):
  double alone_ms = 0;
  int gathers = 0;         // all-gathers Fsdp issued (waits().gathers)
  int reduces = 0;         // reduce-scatters (waits().reduces)
  int replayed = 0;        // collectives replayed alone (should be their sum)
  double gathered_mb = 0;  // one rank's all-gather outputs, MB
  double reduced_mb = 0;   // one rank's reduce-scatter inputs, MB
};

// `config` names its training data; its model, micro-batch and
// parallel.bucket_mb (DDP) are used. `zero`: 0 for DDP, else the ZeRO
// stage, gathering parameters in `gather`. `warmup` steps first, untimed. `pin`: rank r's training
// thread runs on the r-th CPU this process may use only (the communication threads still go
// wherever the scheduler puts them).
absl::StatusOr<ThreadsRun> RunThreadsJob(const worker::TrainConfig& config, int zero,
                                         worker::GatherDtype gather, int ranks, int warmup,
                                         int steps, int replays, bool pin);

}  // namespace muster::tools
