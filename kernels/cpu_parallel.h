// Parallel loops for the CPU back end (kernels/*_cpu.cc only), on OpenMP.
// Each task's writes are its own, and every reduction runs inside one
// task in a fixed order, so results do not depend on the thread count.
#pragma once

#include <algorithm>

namespace muster::kernels::cpu {

// Channels per task in the parameter-gradient loops: one 64-byte cache
// line of floats, so no two threads write the same line.
constexpr int kChannelsPerTask = 16;

// fn(i) for i in [0, count), split statically across threads.
template <typename Fn>
void ParallelFor(long count, Fn fn) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < count; ++i) fn(i);
}

// fn(begin, end) over [0, channels) in ranges of kChannelsPerTask.
template <typename Fn>
void ParallelForChannelRanges(int channels, Fn fn) {
  const int tasks = (channels + kChannelsPerTask - 1) / kChannelsPerTask;
#pragma omp parallel for schedule(static)
  for (int task = 0; task < tasks; ++task) {
    const int begin = task * kChannelsPerTask;
    fn(begin, std::min(channels, begin + kChannelsPerTask));
  }
}

}  // namespace muster::kernels::cpu
