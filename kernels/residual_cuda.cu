// Thin CUDA launchers over the element math in residual.h.
#include "kernels/cuda_launch.cuh"
#include "kernels/residual.h"

namespace muster::kernels {
namespace {

__global__ void ForwardKernel(float* out, const float* inp1, const float* inp2, size_t n) {
  size_t i = cuda::GlobalThread();
  if (i < n) out[i] = ResidualForwardElem(inp1[i], inp2[i]);
}

__global__ void BackwardKernel(float* dinp1, float* dinp2, const float* dout, size_t n) {
  size_t i = cuda::GlobalThread();
  if (i < n) ResidualBackwardElem(dinp1 + i, dinp2 + i, dout[i]);
}

}  // namespace

int ResidualForwardCuda(float* out, const float* inp1, const float* inp2, size_t n, void* stream) {
  if (n == 0) return 0;
  ForwardKernel<<<cuda::Blocks(n), cuda::kBlock, 0, cuda::AsStream(stream)>>>(out, inp1, inp2, n);
  return cuda::LaunchStatus();
}

int ResidualBackwardCuda(float* dinp1, float* dinp2, const float* dout, size_t n, void* stream) {
  if (n == 0) return 0;
  BackwardKernel<<<cuda::Blocks(n), cuda::kBlock, 0, cuda::AsStream(stream)>>>(dinp1, dinp2, dout,
                                                                               n);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
