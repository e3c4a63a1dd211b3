// Whole-job throughput for tools/bench_ddp: our `worker` as a world of one
// and as N ranks under `launch --standalone`, and PyTorch DDP (gloo) on
// the same model under the same launcher (tools/bench_ddp_torch.py).
// Every rank gets one core's worth of threads: launch sets
// OMP_NUM_THREADS=1 for its workers, and the world-of-one run is given
// the same.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "worker/config/config.h"

namespace muster::tools {

struct Throughput {
  double tokens_per_s = 0;  // global: every rank's tokens
  double ms_per_step = 0;
  int steps = 0;  // timed steps
};

struct JobPaths {
  std::string launch;  // launcher/launch
  std::string worker;  // worker/worker
  std::string dir;     // scratch: data, yaml, metrics, logs
};

// Writes `dir`/train_000.bin (random tokens < vocab) for the jobs.
absl::Status WriteBenchData(const std::string& dir, int vocab);

// Trains `config` (its data.train and train.steps are set here) with
// `nproc` ranks: 1 runs the worker directly, more run it under launch.
// Throughput is over the steps after `warmup`, from the metrics JSONL
// (tokens = tokens_per_s * ms of each step, summed, over the summed ms).
absl::StatusOr<Throughput> RunWorkerJob(const JobPaths& paths, worker::TrainConfig config,
                                        int nproc, int warmup, int steps);

// PyTorch DDP (gloo) on the same model and micro-batch under launch:
// `script` is tools/bench_ddp_torch.py. NOT_FOUND when /usr/bin/python3
// cannot import torch.
absl::StatusOr<Throughput> RunTorchDdpJob(const JobPaths& paths, const std::string& script,
                                          const worker::TrainConfig& config, int nproc, int warmup,
                                          int steps);

}  // namespace muster::tools
