// Global gradient norm and clipping, as in llm.c's trainer:
//   norm = sqrt(sum over every gradient buffer of sum(g^2))
//   scale = norm > max_norm ? max_norm / norm : 1;  g *= scale
// A model's gradients live in several buffers and, under data or model
// parallelism, on several ranks, so the kernels stop at one buffer's sum of
// squares (in double); the caller adds the buffers' sums (and all-reduces
// them across ranks) before taking the square root.
//
// Determinism: a buffer is summed in fixed chunks of kSumOfSquaresChunk
// elements, and the chunk sums are added in chunk order, so the result
// does not depend on the number of threads.
// Shapes: x (n). Aliasing: none.
#pragma once

#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

constexpr size_t kSumOfSquaresChunk = 4096;

// sum of x[i]^2 for i = begin, begin + stride, ... < end, in double.
MUSTER_HD double SumOfSquaresStrided(const float* x, size_t begin, size_t end, size_t stride) {
  double sum = 0.0;
  for (size_t i = begin; i < end; i += stride) {
    sum += static_cast<double>(x[i]) * x[i];
  }
  return sum;
}

// The factor that brings a gradient of norm global_norm down to max_norm
// (1 when it is already within it).
MUSTER_HD float ClipScale(double global_norm, float max_norm) {
  return global_norm > max_norm ? static_cast<float>(max_norm / global_norm) : 1.0f;
}

// ---- CPU back end (host pointers) ----
double SumOfSquaresCpu(const float* x, size_t n);
// x (n) *= scale.
void ScaleCpu(float* x, size_t n, float scale);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
// Writes the sum to *result (one device double, left on the device so it
// can be all-reduced). scratch holds SumOfSquaresCudaScratch(n) doubles.
size_t SumOfSquaresCudaScratch(size_t n);
int SumOfSquaresCuda(double* result, double* scratch, const float* x, size_t n, void* stream);
int ScaleCuda(float* x, size_t n, float scale, void* stream);

}  // namespace muster::kernels
