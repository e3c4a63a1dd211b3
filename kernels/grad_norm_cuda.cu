// Deterministic two-level sum of squares: one block per chunk of
// kSumOfSquaresChunk elements reduces in a fixed tree, then one block
// reduces the chunk sums the same way. No atomics, so the bits do not
// depend on scheduling.
#include "kernels/cuda_launch.cuh"
#include "kernels/grad_norm.h"

namespace muster::kernels {
namespace {

// Tree-reduces `partial` (one value per thread, kBlock threads) into
// partial[0].
__device__ void BlockReduce(double* partial) {
  for (int width = cuda::kBlock / 2; width > 0; width /= 2) {
    __syncthreads();
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
  }
  __syncthreads();
}

__global__ void ChunkSumsKernel(double* chunk_sums, const float* x, size_t n) {
  __shared__ double partial[cuda::kBlock];
  const size_t begin = blockIdx.x * kSumOfSquaresChunk;
  const size_t end = begin + kSumOfSquaresChunk < n ? begin + kSumOfSquaresChunk : n;
  partial[threadIdx.x] = SumOfSquaresStrided(x, begin + threadIdx.x, end, cuda::kBlock);
  BlockReduce(partial);
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = partial[0];
}

__global__ void TotalKernel(double* result, const double* chunk_sums, size_t chunks) {
  __shared__ double partial[cuda::kBlock];
  double sum = 0.0;
  for (size_t i = threadIdx.x; i < chunks; i += cuda::kBlock) sum += chunk_sums[i];
  partial[threadIdx.x] = sum;
  BlockReduce(partial);
  if (threadIdx.x == 0) *result = partial[0];
}

__global__ void ScaleKernel(float* x, size_t n, float scale) {
  size_t i = cuda::GlobalThread();
  if (i < n) x[i] *= scale;
}

}  // namespace

size_t SumOfSquaresCudaScratch(size_t n) {
  return (n + kSumOfSquaresChunk - 1) / kSumOfSquaresChunk;
}

int SumOfSquaresCuda(double* result, double* scratch, const float* x, size_t n, void* stream) {
  const size_t chunks = SumOfSquaresCudaScratch(n);
  if (chunks > 0) {
    ChunkSumsKernel<<<static_cast<unsigned>(chunks), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
        scratch, x, n);
    int status = cuda::LaunchStatus();
    if (status != 0) return status;
  }
  // With n == 0 this still runs, and writes 0.
  TotalKernel<<<1, cuda::kBlock, 0, cuda::AsStream(stream)>>>(result, scratch, chunks);
  return cuda::LaunchStatus();
}

int ScaleCuda(float* x, size_t n, float scale, void* stream) {
  if (n == 0) return 0;
  ScaleKernel<<<cuda::Blocks(n), cuda::kBlock, 0, cuda::AsStream(stream)>>>(x, n, scale);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
