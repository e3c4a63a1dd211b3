// Thin CUDA launcher over the element math in adamw.h.
#include "kernels/adamw.h"
#include "kernels/cuda_launch.cuh"

namespace muster::kernels {
namespace {

// hyper is passed by value: kernel arguments live in constant memory.
__global__ void UpdateKernel(float* params, float* m, float* v, const float* grads, size_t n,
                             AdamWHyper hyper, float bias_correction1, float bias_correction2) {
  size_t i = cuda::GlobalThread();
  if (i < n) {
    AdamWElem(params + i, m + i, v + i, grads[i], hyper, bias_correction1, bias_correction2);
  }
}

}  // namespace

int AdamWUpdateCuda(float* params, float* m, float* v, const float* grads, size_t n,
                    const AdamWHyper& hyper, int step, void* stream) {
  if (n == 0) return 0;
  UpdateKernel<<<cuda::Blocks(n), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      params, m, v, grads, n, hyper, AdamWBiasCorrection(hyper.beta1, step),
      AdamWBiasCorrection(hyper.beta2, step));
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
