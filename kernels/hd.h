// MUSTER_HD marks math that both back ends run: nvcc compiles it for the
// device and the host; g++ sees a plain inline function. Keep each such
// function free of state so the CPU tests exercise exactly what a GPU runs.
#pragma once

#if defined(__CUDACC__)
#define MUSTER_HD __host__ __device__ __forceinline__
#else
#define MUSTER_HD inline __attribute__((always_inline))
#endif

// MUSTER_SIMD asks g++ to vectorize the loop that follows (OpenMP simd, in
// the CPU back end's -fopenmp files); MUSTER_SIMD_MAX(x) also lets it take
// the running maximum x across vector lanes, which cannot change the
// result: max is exact. Both are nothing elsewhere: a CUDA thread runs the
// loop as written.
#define MUSTER_PRAGMA(text) _Pragma(#text)
#if defined(_OPENMP) && !defined(__CUDACC__)
#define MUSTER_SIMD MUSTER_PRAGMA(omp simd)
#define MUSTER_SIMD_MAX(x) MUSTER_PRAGMA(omp simd reduction(max : x))
#else
#define MUSTER_SIMD
#define MUSTER_SIMD_MAX(x)
#endif

namespace muster::kernels {

// Row sums in kSumLanes interleaved partial sums: lane l adds terms l,
// l + kSumLanes, ... in index order, then the lanes are added in lane
// order. The order is fixed, so any vector width (or a GPU thread) gets
// the same bits, and a row of n costs n / kSumLanes dependent adds, not n.
constexpr int kSumLanes = 16;

// sum_i term(i) for i in [0, n), in the lane order above.
template <typename Term>
MUSTER_HD float LaneSum(int n, Term term) {
  float lanes[kSumLanes];
  for (int l = 0; l < kSumLanes; ++l) lanes[l] = 0.0f;
  int i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    MUSTER_SIMD
    for (int l = 0; l < kSumLanes; ++l) lanes[l] += term(i + l);
  }
  for (int l = 0; i + l < n; ++l) lanes[l] += term(i + l);
  float sum = 0.0f;
  for (int l = 0; l < kSumLanes; ++l) sum += lanes[l];
  return sum;
}

}  // namespace muster::kernels
