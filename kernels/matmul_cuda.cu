// cuBLAS GEMMs plus thin kernels over the bias math in matmul.h.
// cuBLAS is column-major: a row-major (R, K) matrix is its (K, R) transpose,
// so each call below is the CPU call with operands swapped (as in llm.c).
#include <cublas_v2.h>

#include "kernels/cuda_launch.cuh"
#include "kernels/matmul.h"

namespace muster::kernels {
namespace {

__global__ void AddBiasKernel(float* out, const float* bias, size_t BT, int OC) {
  size_t i = cuda::GlobalThread();
  if (i < BT * OC) out[i] += bias[i % OC];
}

__global__ void BiasGradKernel(float* dbias, const float* dout, size_t BT, int OC) {
  size_t o = cuda::GlobalThread();
  if (o < static_cast<size_t>(OC)) {
    MatmulBiasGradChannels(dbias, dout, BT, OC, static_cast<int>(o), static_cast<int>(o) + 1);
  }
}

int CublasStatus(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? 0 : kCublasErrorBase + static_cast<int>(status);
}

}  // namespace

int MatmulForwardCuda(float* out, const float* inp, const float* weight, const float* bias,
                      size_t BT, int C, int OC, void* cublas, void* stream) {
  if (BT == 0 || OC == 0) return 0;
  auto handle = static_cast<cublasHandle_t>(cublas);
  int status = CublasStatus(cublasSetStream(handle, cuda::AsStream(stream)));
  if (status != 0) return status;
  const float one = 1.0f, zero = 0.0f;
  // out^T (OC, BT) = weight (OC, C) @ inp^T (C, BT).
  status = CublasStatus(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, OC, static_cast<int>(BT), C,
                                    &one, weight, C, inp, C, &zero, out, OC));
  if (status != 0 || bias == nullptr) return status;
  AddBiasKernel<<<cuda::Blocks(BT * OC), cuda::kBlock, 0, cuda::AsStream(stream)>>>(out, bias, BT,
                                                                                    OC);
  return cuda::LaunchStatus();
}

int MatmulBackwardCuda(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, size_t BT, int C, int OC,
                       void* cublas, void* stream) {
  if (BT == 0) return 0;
  auto handle = static_cast<cublasHandle_t>(cublas);
  int status = CublasStatus(cublasSetStream(handle, cuda::AsStream(stream)));
  if (status != 0) return status;
  const float one = 1.0f;
  const int rows = static_cast<int>(BT);
  if (dinp != nullptr) {
    // dinp^T (C, BT) += weight^T (C, OC) @ dout^T (OC, BT).
    status = CublasStatus(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, C, rows, OC, &one, weight,
                                      C, dout, OC, &one, dinp, C));
    if (status != 0) return status;
  }
  // dweight^T (C, OC) += inp^T (C, BT) @ dout (BT, OC).
  status = CublasStatus(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, rows, &one, inp, C,
                                    dout, OC, &one, dweight, C));
  if (status != 0 || dbias == nullptr) return status;
  BiasGradKernel<<<cuda::Blocks(OC), cuda::kBlock, 0, cuda::AsStream(stream)>>>(dbias, dout, BT,
                                                                                OC);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
