// Parallel loops for the CPU back end (kernels/*_cpu.cc only), on OpenMP.
// Each task's writes are its own, and every reduction runs inside one
// task in a fixed order, so results do not depend on the thread count.
#pragma once

#include <algorithm>

namespace muster::kernels::cpu {

// Channels per task in the parameter-gradient loops: four 64-byte cache
// lines of floats, so no two threads write the same line, and each row's
// slice is long enough to stream (one line per row thrashed the cache at
// OC = 1024). Each channel sums its rows in order, so the width does not
// change the bits.
constexpr int kChannelsPerTask = 64;

// Rows per task in the row loops (LayerNorm, cross-entropy): each row's
// work is its own, so the split cannot change a bit.
constexpr long kRowsPerTask = 16;

// Elements per task in ParallelForRanges: 64 KiB of floats.
constexpr long kElementsPerTask = 1 << 14;

// Clones of a hot loop for AVX-512, AVX2 and baseline x86-64, chosen when
// the program loads (the binary must run on any x86-64, so no -march).
// No clone fuses a multiply and an add (kernels/BUILD.bazel builds with
// -ffp-contract=off: the AVX-512 clone could), and no loop given clones
// reduces across its vector lanes in an order of the vector width's
// (LaneSum's lanes are fixed), so every clone computes the same bits.
#define MUSTER_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// fn(begin, end) over [0, count) in ranges of `block`, split statically.
template <typename Fn>
void ParallelForBlocks(long count, long block, Fn fn) {
  const long tasks = (count + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (long task = 0; task < tasks; ++task) {
    const long begin = task * block;
    fn(begin, std::min(count, begin + block));
  }
}

// fn(begin, end) over [0, count) in ranges of kElementsPerTask.
template <typename Fn>
void ParallelForRanges(long count, Fn fn) {
  ParallelForBlocks(count, kElementsPerTask, fn);
}

// fn(i) for i in [0, count), split statically across threads.
template <typename Fn>
void ParallelFor(long count, Fn fn) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < count; ++i) fn(i);
}

// fn(begin, end) over [0, channels) in ranges of kChannelsPerTask.
template <typename Fn>
void ParallelForChannelRanges(int channels, Fn fn) {
  ParallelForBlocks(channels, kChannelsPerTask, [&](long begin, long end) {
    fn(static_cast<int>(begin), static_cast<int>(end));
  });
}

}  // namespace muster::kernels::cpu
