// GELU with the tanh approximation, as in GPT-2:
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// The per-element math is shared by the CPU loop and the CUDA kernel.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

MUSTER_HD float GeluForwardElem(float x) {
  float cube = kGeluCubic * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

// d gelu(x) / dx, times the upstream gradient.
MUSTER_HD float GeluBackwardElem(float x, float grad_out) {
  float cube = kGeluCubic * x * x * x;
  float tanh_arg = kGeluScale * (x + cube);
  float tanh_out = tanhf(tanh_arg);
  float cosh_out = coshf(tanh_arg);
  float sech_sq = 1.0f / (cosh_out * cosh_out);
  float local_grad = 0.5f * (1.0f + tanh_out) +
                     x * 0.5f * sech_sq * kGeluScale *
                         (1.0f + 3.0f * kGeluCubic * x * x);
  return local_grad * grad_out;
}

// CPU back end. out, in: (n,). May run in place (out == in).
void GeluForwardCpu(float* out, const float* in, size_t n);
// grad_in, in, grad_out: (n,). grad_in may alias grad_out.
void GeluBackwardCpu(float* grad_in, const float* in, const float* grad_out,
                     size_t n);

// CUDA back end (--config=cuda only): device pointers, enqueued on `stream`
// (a cudaStream_t, passed as void* so host code needs no CUDA headers).
// Returns 0 on success or the cudaError_t of the launch.
int GeluForwardCuda(float* out, const float* in, size_t n, void* stream);
int GeluBackwardCuda(float* grad_in, const float* in, const float* grad_out,
                     size_t n, void* stream);

}  // namespace muster::kernels
