// One pipeline job of tools/bench_pp: P ranks as threads of this process,
// each a real worker::Trainer whose strategy is a worker::Pipeline over
// real Gloo groups joined through an in-memory store
// (parallel/local_ranks.h): a 2-rank group per direction between
// neighbouring ranks (with virtual stages also from the last rank back to
// the first, closing the ring interleaved 1F1B sends over), the pipeline
// group and the tied group of the first and last rank, as worker_main
// builds them (tests/worker/strategy/pipeline_test.cc builds the same).
//
// Per timed step and rank it keeps Pipeline::last_step_times() (seconds
// from when that rank's ForwardBackward began) and puts them on one clock:
// the strategy is wrapped, and the wrapper notes absl::Now() just before
// it calls Pipeline::ForwardBackward (which takes its own start a few
// microseconds later, after building the schedule's lists), and the
// training thread's CPU time (CLOCK_THREAD_CPUTIME_ID) around the call.
// The CPU time of each action is sampled from outside
// (tools/pp/cpu.h, every millisecond).
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/pipeline_schedule.h"
#include "worker/config/config.h"
#include "worker/strategy/pipeline/pipeline.h"

namespace muster::tools {

// One rank's ForwardBackward of one step.
struct RankStep {
  std::vector<worker::Pipeline::ActionTime> times;  // last_step_times()
  std::vector<double> action_cpu_s;  // per action of `times`: the thread's CPU time in it
  double began_s = 0;                // its ForwardBackward's start, on the job's clock
  double wall_s = 0;                 // the call, wall clock
  double cpu_s = 0;                  // the call, the training thread's CPU time
};

struct PipelineRun {
  std::vector<std::vector<RankStep>> steps;  // [timed step][rank]
  std::vector<int> split;                    // blocks per pipeline stage (P x V of them)
  std::vector<size_t> activation_bytes;      // per rank: Pipeline::ActivationBytes(), all chunks
  std::vector<int> peak_in_flight;           // per rank, over every step (virtual micro-batches)
  double seconds = 0;                        // the whole job
};

// Trains `config` (its model, data and micro_batch; M is
// data.grad_accumulation) on `pp` ranks under `schedule` with
// `virtual_stages` stages per rank (1 except for interleaved 1F1B):
// `warmup` untimed steps, then `steps` timed.
absl::StatusOr<PipelineRun> RunPipelineJob(worker::TrainConfig config, int pp,
                                           parallel::ScheduleKind schedule, int virtual_stages,
                                           int warmup, int steps);

}  // namespace muster::tools
