// Thin CUDA launchers over the math in encoder.h: one thread per position
// (forward) or per channel (backward, race-free without atomics).
#include "kernels/cuda_launch.cuh"
#include "kernels/encoder.h"

namespace muster::kernels {
namespace {

__global__ void ForwardKernel(float* out, const int* tokens, const float* wte, const float* wpe,
                              int B, int T, int C) {
  size_t row = cuda::GlobalThread();
  if (row < static_cast<size_t>(B) * T) {
    EncoderRowForward(out + row * C, wte + static_cast<size_t>(tokens[row]) * C,
                      wpe + (row % T) * C, C);
  }
}

__global__ void BackwardKernel(float* dwte, float* dwpe, const float* dout, const int* tokens,
                               int B, int T, int C) {
  size_t c = cuda::GlobalThread();
  if (c < static_cast<size_t>(C)) {
    EncoderChannelsBackward(dwte, dwpe, dout, tokens, B, T, C, static_cast<int>(c),
                            static_cast<int>(c) + 1);
  }
}

}  // namespace

int EncoderForwardCuda(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, void* stream) {
  const size_t rows = static_cast<size_t>(B) * T;
  if (rows == 0) return 0;
  ForwardKernel<<<cuda::Blocks(rows), cuda::kBlock, 0, cuda::AsStream(stream)>>>(out, tokens, wte,
                                                                                 wpe, B, T, C);
  return cuda::LaunchStatus();
}

int EncoderBackwardCuda(float* dwte, float* dwpe, const float* dout, const int* tokens, int B,
                        int T, int C, void* stream) {
  if (C == 0) return 0;
  BackwardKernel<<<cuda::Blocks(C), cuda::kBlock, 0, cuda::AsStream(stream)>>>(dwte, dwpe, dout,
                                                                               tokens, B, T, C);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
