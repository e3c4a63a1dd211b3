#include "kernels/gelu.h"

namespace muster::kernels {

void GeluForwardCpu(float* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = GeluForwardElem(in[i]);
}

void GeluBackwardCpu(float* grad_in, const float* in, const float* grad_out,
                     size_t n) {
  for (size_t i = 0; i < n; ++i) grad_in[i] = GeluBackwardElem(in[i], grad_out[i]);
}

}  // namespace muster::kernels
