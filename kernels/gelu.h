// GELU with the tanh approximation, as in GPT-2:
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// The per-element math is shared by the CPU loop and the CUDA kernel.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>

#include "kernels/exp_math.h"
#include "kernels/hd.h"

namespace muster::kernels {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// tanh and sech^2 of u from z = e^{-2|u|}:
//   tanh u = sign(u) (1 - z) / (1 + z),  sech^2 u = 4 z / (1 + z)^2.
// sech^2 keeps its relative precision where it is tiny (|u| large), which
// 1 - tanh^2 would not. The exponential is kernels/exp_math.h's, free of
// calls and branches so that the CPU loops vectorize; libm's tanhf and
// coshf do not. Accuracy against double: tests/kernels/gelu_test.cc.
struct GeluTanhSech {
  float tanh_u;
  float sech_sq;
};

MUSTER_HD GeluTanhSech GeluTanhAndSechSq(float u) {
  const float abs_u = u < 0.0f ? -u : u;
  const float z = ExpNonPositive(-2.0f * abs_u);
  const float inv_one_plus_z = 1.0f / (1.0f + z);
  const float tanh_abs = (1.0f - z) * inv_one_plus_z;
  return GeluTanhSech{u < 0.0f ? -tanh_abs : tanh_abs, 4.0f * z * inv_one_plus_z * inv_one_plus_z};
}

MUSTER_HD float GeluForwardElem(float x) {
  float cube = kGeluCubic * x * x * x;
  return 0.5f * x * (1.0f + GeluTanhAndSechSq(kGeluScale * (x + cube)).tanh_u);
}

// d gelu(x) / dx, times the upstream gradient.
MUSTER_HD float GeluBackwardElem(float x, float grad_out) {
  float cube = kGeluCubic * x * x * x;
  const GeluTanhSech th = GeluTanhAndSechSq(kGeluScale * (x + cube));
  float local_grad = 0.5f * (1.0f + th.tanh_u) +
                     x * 0.5f * th.sech_sq * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return local_grad * grad_out;
}

// CPU back end. out, in: (n,). May run in place (out == in).
void GeluForwardCpu(float* out, const float* in, size_t n);
// grad_in, in, grad_out: (n,). grad_in may alias grad_out or in (elementwise).
void GeluBackwardCpu(float* grad_in, const float* in, const float* grad_out, size_t n);

// CUDA back end (--config=cuda only): device pointers, enqueued on `stream`
// (a cudaStream_t, passed as void* so host code needs no CUDA headers).
// Returns 0 on success or the cudaError_t of the launch.
int GeluForwardCuda(float* out, const float* in, size_t n, void* stream);
int GeluBackwardCuda(float* grad_in, const float* in, const float* grad_out, size_t n,
                     void* stream);

}  // namespace muster::kernels
