// Helpers shared by the CUDA launchers (kernels/*_cuda.cu); not part of the
// API. Every launcher returns 0 on success, a cudaError_t from a kernel
// launch, or kCublasErrorBase + a cublasStatus_t (see matmul.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace muster::kernels::cuda {

constexpr int kBlock = 256;

inline unsigned Blocks(size_t threads) {
  return static_cast<unsigned>((threads + kBlock - 1) / kBlock);
}

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// The error of the most recent launch, as the launchers' int status.
inline int LaunchStatus() { return static_cast<int>(cudaGetLastError()); }

// The index of this thread in a 1-D grid.
__device__ __forceinline__ size_t GlobalThread() {
  return blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
}

}  // namespace muster::kernels::cuda
