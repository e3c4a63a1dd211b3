// Allreduce bus bandwidth over loopback for tools/bench_ddp: our
// ProcessGroup (parallel/gloo/group.h) against gloo's ring allreduce called
// directly on a context of its own, ranks as threads of this process.
//
// busbw = 2 (n - 1) / n * bytes / time, the bytes each rank's link carries
// in a bandwidth-optimal allreduce (NCCL's convention), so rank counts
// compare on one scale.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::tools {

struct AllreduceFigures {
  size_t bytes = 0;
  int iterations = 0;
  double ours_us = 0;  // per allreduce, the slowest rank's mean
  double gloo_us = 0;
  double ours_busbw_gbs = 0;  // GB/s (1e9 bytes)
  double gloo_busbw_gbs = 0;
};

// For each size (bytes, a multiple of 4): 2 untimed allreduces, then
// `iterations` timed ones for ours and for gloo in turn, on `ranks` threads.
// The iteration count falls with size so every size takes similar time.
absl::StatusOr<std::vector<AllreduceFigures>> MeasureAllreduce(int ranks,
                                                               const std::vector<size_t>& sizes);

}  // namespace muster::tools
