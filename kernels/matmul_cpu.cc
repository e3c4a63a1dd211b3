#include <algorithm>
#include <cstdlib>

#include "kernels/cpu_gemm.h"
#include "kernels/cpu_parallel.h"
#include "kernels/matmul.h"

namespace muster::kernels {
namespace {

// out rows [row_begin, row_end) (OC each) += bias.
MUSTER_CPU_CLONES void AddBiasRows(float* out, const float* bias, long OC, long row_begin,
                                   long row_end) {
  for (long row = row_begin; row < row_end; ++row) {
    float* out_row = out + row * OC;
#pragma omp simd
    for (long o = 0; o < OC; ++o) out_row[o] += bias[o];
  }
}

// MatmulBiasGradChannels, vectorized across the channels: each channel
// still adds its rows in order, so the bits are the same.
MUSTER_CPU_CLONES void BiasGradChannels(float* dbias, const float* dout, long BT, long OC,
                                        int o_begin, int o_end) {
  for (long row = 0; row < BT; ++row) {
    const float* dout_row = dout + row * OC;
#pragma omp simd
    for (int o = o_begin; o < o_end; ++o) dbias[o] += dout_row[o];
  }
}

}  // namespace

std::string CpuGemmDescription() {
  // openblas_get_config() starts "OpenBLAS 0.3.21 ...": its version.
  const char* config = openblas_get_config();
  std::string version = config != nullptr ? config : "OpenBLAS";
  if (size_t second_space = version.find(' ', version.find(' ') + 1);
      second_space != std::string::npos) {
    version.resize(second_space);
  }
  std::string description = version + ", " + openblas_get_corename() + " kernels";
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE"); forced != nullptr && *forced != 0) {
    description += std::string(" (OPENBLAS_CORETYPE=") + forced + " in the environment)";
  }
  return description;
}

// The GEMMs run in OpenMP's threads, split by output rows (cpu_gemm.h).

void MatmulForwardCpu(float* out, const float* inp, const float* weight, const float* bias,
                      size_t BT, int C, int OC) {
  if (BT == 0 || OC == 0) return;
  const int rows = static_cast<int>(BT);
  // out (BT, OC) = inp (BT, C) @ weight^T (C, OC).
  cpu::ParallelSgemm(false, true, rows, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC);
  if (bias == nullptr) return;
  // About cpu::kElementsPerTask elements per task.
  const long rows_per_task = std::max(1L, cpu::kElementsPerTask / OC);
  cpu::ParallelForBlocks(rows, rows_per_task,
                         [=](long begin, long end) { AddBiasRows(out, bias, OC, begin, end); });
}

void MatmulBackwardCpu(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, size_t BT, int C, int OC) {
  if (BT == 0) return;
  const int rows = static_cast<int>(BT);
  if (dinp != nullptr) {
    // dinp (BT, C) += dout (BT, OC) @ weight (OC, C).
    cpu::ParallelSgemm(false, false, rows, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C);
  }
  // dweight (OC, C) += dout^T (OC, BT) @ inp (BT, C).
  if (dweight != nullptr) {
    cpu::ParallelSgemm(true, false, OC, C, rows, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  }
  if (dbias == nullptr) return;
  cpu::ParallelForChannelRanges(OC, [=](int begin, int end) {
    BiasGradChannels(dbias, dout, static_cast<long>(BT), OC, begin, end);
  });
}

}  // namespace muster::kernels
