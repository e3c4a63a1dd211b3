// Fully connected layer, as llm.c's matmul_forward / matmul_backward:
//   out = inp @ weight^T + bias
// Shapes (row-major; BT = B*T rows, B batch, T time):
//   inp (BT, C), weight (OC, C), bias (OC) or nullptr, out (BT, OC).
// The GEMMs go to OpenBLAS cblas_sgemm (CPU) or cuBLAS (GPU); only the bias
// math is ours, shared by both back ends below.
//
// Backward functions ACCUMULATE (+=) into dinp, dweight and dbias, as llm.c
// does: a tensor read by several ops sums their gradients, and the caller
// zeroes gradients once per step.
// Aliasing: outputs must not alias inputs.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/hd.h"

namespace muster::kernels {

// Output channels [o_begin, o_end) of dbias: dbias[o] += dout[row, o] for
// every row, rows in order, so the result does not depend on how channels
// are split among threads. dout (BT, OC). (matmul_cpu.cc has a vectorized
// copy: keep the two in step.)
MUSTER_HD void MatmulBiasGradChannels(float* dbias, const float* dout, size_t BT, int OC,
                                      int o_begin, int o_end) {
  for (size_t row = 0; row < BT; ++row) {
    const float* dout_row = dout + row * OC;
    for (int o = o_begin; o < o_end; ++o) dbias[o] += dout_row[o];
  }
}

// ---- CPU back end (host pointers) ----
// Which GEMM kernels the CPU back end runs: OpenBLAS's version and the
// kernels it picked for this CPU (e.g. "OpenBLAS 0.3.21, Cooperlake
// kernels"), and OPENBLAS_CORETYPE when the environment sets it, which
// overrides OpenBLAS's choice: Haswell's (AVX2) kernels on an AVX-512 CPU
// run GEMMs at about half the speed.
std::string CpuGemmDescription();
// out (BT, OC) is overwritten.
void MatmulForwardCpu(float* out, const float* inp, const float* weight, const float* bias,
                      size_t BT, int C, int OC);
// dinp (BT, C), dweight (OC, C), dbias (OC) accumulate; dbias may be
// nullptr when the layer has no bias. dinp may be nullptr when the input
// needs no gradient (e.g. it is data), and dweight and dbias both when
// only the input's is wanted now (a pipeline's split backward computes
// the weights' later from the same dout).
void MatmulBackwardCpu(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, size_t BT, int C, int OC);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers; work is enqueued on `stream` (a cudaStream_t), and
// `cublas` is a cublasHandle_t whose stream is set to `stream`. Both are
// void* so host code needs no CUDA headers. Returns 0 on success, a
// cudaError_t from a launch, or kCublasErrorBase + a cublasStatus_t.
constexpr int kCublasErrorBase = 1 << 16;

int MatmulForwardCuda(float* out, const float* inp, const float* weight, const float* bias,
                      size_t BT, int C, int OC, void* cublas, void* stream);
int MatmulBackwardCuda(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, size_t BT, int C, int OC,
                       void* cublas, void* stream);

}  // namespace muster::kernels
