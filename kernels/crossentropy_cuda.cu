// Thin CUDA launchers over the math in crossentropy.h: one thread per row
// for the forward pass, one per logit for the backward pass.
#include "kernels/crossentropy.h"
#include "kernels/cuda_launch.cuh"

namespace muster::kernels {
namespace {

__global__ void ForwardKernel(float* losses, float* lse, const float* logits, const int* targets,
                              size_t N, int V, int Vp) {
  size_t row = cuda::GlobalThread();
  if (row < N) {
    losses[row] = CrossEntropyRowForward(lse + row, logits + row * Vp, V, targets[row]);
  }
}

__global__ void BackwardKernel(float* dlogits, const float* logits, const float* lse,
                               const int* targets, float dloss, size_t N, int V, int Vp) {
  size_t i = cuda::GlobalThread();
  if (i < N * Vp) {
    size_t row = i / Vp;
    dlogits[i] = CrossEntropyBackwardElem(logits[i], lse[row], static_cast<int>(i % Vp), V,
                                          targets[row], dloss);
  }
}

}  // namespace

int CrossEntropyForwardCuda(float* losses, float* lse, const float* logits, const int* targets,
                            size_t N, int V, int Vp, void* stream) {
  if (N == 0) return 0;
  ForwardKernel<<<cuda::Blocks(N), cuda::kBlock, 0, cuda::AsStream(stream)>>>(losses, lse, logits,
                                                                              targets, N, V, Vp);
  return cuda::LaunchStatus();
}

int CrossEntropyBackwardCuda(float* dlogits, const float* logits, const float* lse,
                             const int* targets, float dloss, size_t N, int V, int Vp,
                             void* stream) {
  if (N == 0) return 0;
  BackwardKernel<<<cuda::Blocks(N * Vp), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      dlogits, logits, lse, targets, dloss, N, V, Vp);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
