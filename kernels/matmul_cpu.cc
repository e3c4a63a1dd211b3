#include "kernels/cpu_gemm.h"
#include "kernels/cpu_parallel.h"
#include "kernels/matmul.h"

namespace muster::kernels {

// The GEMMs run in OpenMP's threads, split by output rows (cpu_gemm.h).

void MatmulForwardCpu(float* out, const float* inp, const float* weight,
                      const float* bias, size_t BT, int C, int OC) {
  if (BT == 0 || OC == 0) return;
  const int rows = static_cast<int>(BT);
  // out (BT, OC) = inp (BT, C) @ weight^T (C, OC).
  cpu::ParallelSgemm(false, true, rows, OC, C, 1.0f, inp, C, weight, C, 0.0f,
                     out, OC);
  if (bias == nullptr) return;
  cpu::ParallelFor(static_cast<long>(BT), [=](long row) {
    MatmulAddBiasRow(out + row * OC, bias, OC);
  });
}

void MatmulBackwardCpu(float* dinp, float* dweight, float* dbias,
                       const float* dout, const float* inp, const float* weight,
                       size_t BT, int C, int OC) {
  if (BT == 0) return;
  const int rows = static_cast<int>(BT);
  if (dinp != nullptr) {
    // dinp (BT, C) += dout (BT, OC) @ weight (OC, C).
    cpu::ParallelSgemm(false, false, rows, C, OC, 1.0f, dout, OC, weight, C,
                       1.0f, dinp, C);
  }
  // dweight (OC, C) += dout^T (OC, BT) @ inp (BT, C).
  cpu::ParallelSgemm(true, false, OC, C, rows, 1.0f, dout, OC, inp, C, 1.0f,
                     dweight, C);
  if (dbias == nullptr) return;
  cpu::ParallelForChannelRanges(OC, [=](int begin, int end) {
    MatmulBiasGradChannels(dbias, dout, BT, OC, begin, end);
  });
}

}  // namespace muster::kernels
