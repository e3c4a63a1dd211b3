// Residual connection, as llm.c's residual_forward / residual_backward:
//   out = inp1 + inp2, element-wise over n = B*T*C values.
// Backward ACCUMULATES (+=) into dinp1 and dinp2 (see matmul.h).
// Aliasing: out may alias inp1 or inp2. dinp1 and dinp2 must not alias
// each other or dout.
#pragma once

#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

MUSTER_HD float ResidualForwardElem(float in1, float in2) { return in1 + in2; }

// Both inputs receive the upstream gradient unchanged.
MUSTER_HD void ResidualBackwardElem(float* din1, float* din2, float dout) {
  *din1 += dout;
  *din2 += dout;
}

// ---- CPU back end (host pointers); all arrays (n,) ----
void ResidualForwardCpu(float* out, const float* inp1, const float* inp2, size_t n);
void ResidualBackwardCpu(float* dinp1, float* dinp2, const float* dout, size_t n);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int ResidualForwardCuda(float* out, const float* inp1, const float* inp2, size_t n, void* stream);
int ResidualBackwardCuda(float* dinp1, float* dinp2, const float* dout, size_t n, void* stream);

}  // namespace muster::kernels
