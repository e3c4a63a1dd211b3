#include "kernels/gelu.h"

namespace muster::kernels {

// Element-wise, so any split across threads gives the same bits. `omp simd`
// vectorizes the loops (GCC's -O2 cost model would not); in-place use is
// fine since each element is read before it is written.

void GeluForwardCpu(float* out, const float* in, size_t n) {
  const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
  for (long i = 0; i < count; ++i) out[i] = GeluForwardElem(in[i]);
}

void GeluBackwardCpu(float* grad_in, const float* in, const float* grad_out,
                     size_t n) {
  const long count = static_cast<long>(n);
#pragma omp parallel for simd schedule(static)
  for (long i = 0; i < count; ++i) {
    grad_in[i] = GeluBackwardElem(in[i], grad_out[i]);
  }
}

}  // namespace muster::kernels
