// Built under --config=cuda only. It references the CUDA runtime, cuBLAS and
// NCCL so a missing symbol fails the link in CI. Run on a GPU machine, it
// checks the GELU kernel against the CPU back end.
#include <cstdio>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "kernels/gelu.h"

int main() {
  int version = 0;
  ncclGetVersion(&version);
  std::printf("nccl %d\n", version);
  cublasHandle_t blas = nullptr;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "no usable GPU: cublasCreate failed\n");
    return 1;
  }
  cublasDestroy(blas);

  constexpr size_t n = 1 << 16;
  std::vector<float> in(n), want(n), got(n);
  for (size_t i = 0; i < n; ++i) in[i] = -4.0f + 8.0f * i / n;
  muster::kernels::GeluForwardCpu(want.data(), in.data(), n);
  float* device = nullptr;
  if (cudaMalloc(&device, n * sizeof(float)) != cudaSuccess) return 1;
  cudaMemcpy(device, in.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  if (muster::kernels::GeluForwardCuda(device, device, n, nullptr) != 0) return 1;
  cudaMemcpy(got.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(device);
  float worst = 0;
  for (size_t i = 0; i < n; ++i) {
    float diff = got[i] > want[i] ? got[i] - want[i] : want[i] - got[i];
    if (diff > worst) worst = diff;
  }
  std::printf("gelu max |gpu - cpu| = %g\n", worst);
  return worst < 1e-5f ? 0 : 1;
}
