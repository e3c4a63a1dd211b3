#include "kernels/fast/adamw.h"
#include "kernels/fast/common.cuh"

namespace muster::kernels::fast {
namespace {

constexpr int kThreads = 256;

// hyper is passed by value: kernel arguments live in constant memory.
__global__ void AdamWKernel(float* params, float* m, float* v, const float* grads, bf16* copy,
                            size_t n, AdamWHyper hyper, float bias_correction1,
                            float bias_correction2) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  AdamWElem(params + i, m + i, v + i, grads[i], hyper, bias_correction1, bias_correction2);
  if (copy != nullptr) copy[i] = __float2bfloat16_rn(params[i]);
}

__global__ void CastKernel(bf16* out, const float* in, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16_rn(in[i]);
}

}  // namespace

int AdamWUpdate(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                size_t n, const AdamWHyper& hyper, int step, void* stream) {
  if (n == 0) return 0;
  AdamWKernel<<<CeilDiv(n, kThreads), kThreads, 0, AsStream(stream)>>>(
      params, m, v, grads, reinterpret_cast<bf16*>(params_bf16), n, hyper,
      AdamWBiasCorrection(hyper.beta1, step), AdamWBiasCorrection(hyper.beta2, step));
  return LaunchStatus();
}

int CastToBf16(uint16_t* out, const float* in, size_t n, void* stream) {
  if (n == 0) return 0;
  CastKernel<<<CeilDiv(n, kThreads), kThreads, 0, AsStream(stream)>>>(
      reinterpret_cast<bf16*>(out), in, n);
  return LaunchStatus();
}

}  // namespace muster::kernels::fast
