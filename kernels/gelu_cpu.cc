#include "kernels/cpu_parallel.h"
#include "kernels/gelu.h"

namespace muster::kernels {
namespace {

// Element-wise, so any split across threads gives the same bits. `omp simd`
// vectorizes the loops (GCC's -O2 cost model would not); in-place use is
// fine since each element is read before it is written.

MUSTER_CPU_CLONES void GeluForwardRange(float* out, const float* in, long begin, long end) {
#pragma omp simd
  for (long i = begin; i < end; ++i) out[i] = GeluForwardElem(in[i]);
}

MUSTER_CPU_CLONES void GeluBackwardRange(float* grad_in, const float* in, const float* grad_out,
                                         long begin, long end) {
#pragma omp simd
  for (long i = begin; i < end; ++i) {
    grad_in[i] = GeluBackwardElem(in[i], grad_out[i]);
  }
}

}  // namespace

void GeluForwardCpu(float* out, const float* in, size_t n) {
  cpu::ParallelForRanges(static_cast<long>(n),
                         [=](long begin, long end) { GeluForwardRange(out, in, begin, end); });
}

void GeluBackwardCpu(float* grad_in, const float* in, const float* grad_out, size_t n) {
  cpu::ParallelForRanges(static_cast<long>(n), [=](long begin, long end) {
    GeluBackwardRange(grad_in, in, grad_out, begin, end);
  });
}

}  // namespace muster::kernels
