// Thin CUDA launchers over the row and column math in layernorm.h: one
// thread per row (forward, dinp) or per channel (dweight, dbias). Simple
// rather than fast; the math is what the CPU tests check.
#include "kernels/cuda_launch.cuh"
#include "kernels/layernorm.h"

namespace muster::kernels {
namespace {

__global__ void ForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                              const float* weight, const float* bias, size_t N, int C) {
  size_t row = cuda::GlobalThread();
  if (row < N) {
    LayerNormRowForward(out + row * C, mean + row, rstd + row, inp + row * C, weight, bias, C);
  }
}

__global__ void BackwardInputKernel(float* dinp, const float* dout, const float* inp,
                                    const float* weight, const float* mean, const float* rstd,
                                    size_t N, int C) {
  size_t row = cuda::GlobalThread();
  if (row < N) {
    LayerNormRowBackwardInput(dinp + row * C, dout + row * C, inp + row * C, weight, mean[row],
                              rstd[row], C);
  }
}

__global__ void BackwardParamsKernel(float* dweight, float* dbias, const float* dout,
                                     const float* inp, const float* mean, const float* rstd,
                                     size_t N, int C) {
  size_t c = cuda::GlobalThread();
  if (c < static_cast<size_t>(C)) {
    LayerNormChannelsBackwardParams(dweight, dbias, dout, inp, mean, rstd, N, C,
                                    static_cast<int>(c), static_cast<int>(c) + 1);
  }
}

}  // namespace

int LayerNormForwardCuda(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, size_t N, int C, void* stream) {
  if (N == 0) return 0;
  ForwardKernel<<<cuda::Blocks(N), cuda::kBlock, 0, cuda::AsStream(stream)>>>(out, mean, rstd, inp,
                                                                              weight, bias, N, C);
  return cuda::LaunchStatus();
}

int LayerNormBackwardCuda(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, size_t N, int C, void* stream) {
  if (N == 0) return 0;
  BackwardInputKernel<<<cuda::Blocks(N), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      dinp, dout, inp, weight, mean, rstd, N, C);
  int status = cuda::LaunchStatus();
  if (status != 0) return status;
  BackwardParamsKernel<<<cuda::Blocks(C), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      dweight, dbias, dout, inp, mean, rstd, N, C);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
