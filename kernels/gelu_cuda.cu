// Thin CUDA launchers over the shared math in gelu.h. The math is tested on
// the CPU (tests/kernels/gelu_test.cc); these only map threads to elements.
#include <cuda_runtime.h>

#include "kernels/gelu.h"

namespace muster::kernels {
namespace {

constexpr int kBlock = 256;

__global__ void GeluForwardKernel(float* out, const float* in, size_t n) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = GeluForwardElem(in[i]);
}

__global__ void GeluBackwardKernel(float* grad_in, const float* in, const float* grad_out,
                                   size_t n) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) grad_in[i] = GeluBackwardElem(in[i], grad_out[i]);
}

unsigned Blocks(size_t n) { return static_cast<unsigned>((n + kBlock - 1) / kBlock); }

}  // namespace

int GeluForwardCuda(float* out, const float* in, size_t n, void* stream) {
  if (n == 0) return 0;
  GeluForwardKernel<<<Blocks(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(out, in, n);
  return static_cast<int>(cudaGetLastError());
}

int GeluBackwardCuda(float* grad_in, const float* in, const float* grad_out, size_t n,
                     void* stream) {
  if (n == 0) return 0;
  GeluBackwardKernel<<<Blocks(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(grad_in, in,
                                                                                  grad_out, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace muster::kernels
