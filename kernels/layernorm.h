// Layer normalization over the channel dimension, as llm.c's
// layernorm_forward / layernorm_backward:
//   out = (inp - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + 1e-5)
// Shapes: N = B*T rows (B batch, T time), C channels.
//   inp, out (N, C); weight, bias (C); mean, rstd (N), saved by the forward
//   pass for the backward pass.
//
// Backward ACCUMULATES (+=) into dinp, dweight and dbias (see matmul.h).
// Aliasing: outputs must not alias inputs.
//
// Parallel split, the same on both back ends: dinp row by row; dweight and
// dbias by ranges of channels, each walking the rows in order, so no two
// threads write one element and the sums have a fixed order.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

constexpr float kLayerNormEps = 1e-5f;

// One row: inp_row, out_row (C); writes *mean and *rstd of the row. The
// row sums are LaneSums (hd.h).
MUSTER_HD void LayerNormRowForward(float* out_row, float* mean, float* rstd, const float* inp_row,
                                   const float* weight, const float* bias, int C) {
  const float row_mean = LaneSum(C, [=](int c) { return inp_row[c]; }) / C;
  // Two passes: the variance of centred values is stable.
  const float sum_sq = LaneSum(C, [=](int c) {
    const float centred = inp_row[c] - row_mean;
    return centred * centred;
  });
  const float row_rstd = 1.0f / sqrtf(sum_sq / C + kLayerNormEps);
  MUSTER_SIMD
  for (int c = 0; c < C; ++c) {
    const float norm = (inp_row[c] - row_mean) * row_rstd;
    out_row[c] = norm * weight[c] + bias[c];
  }
  *mean = row_mean;
  *rstd = row_rstd;
}

// One row of d loss / d inp: dinp_row, dout_row, inp_row (C).
//   dinp += rstd * (g - mean(g) - norm * mean(g * norm)), g = weight * dout
MUSTER_HD void LayerNormRowBackwardInput(float* dinp_row, const float* dout_row,
                                         const float* inp_row, const float* weight, float mean,
                                         float rstd, int C) {
  const float g_mean = LaneSum(C, [=](int c) { return weight[c] * dout_row[c]; }) / C;
  const float g_norm_mean = LaneSum(C,
                                    [=](int c) {
                                      const float norm = (inp_row[c] - mean) * rstd;
                                      return weight[c] * dout_row[c] * norm;
                                    }) /
                            C;
  MUSTER_SIMD
  for (int c = 0; c < C; ++c) {
    const float norm = (inp_row[c] - mean) * rstd;
    const float g = weight[c] * dout_row[c];
    dinp_row[c] += rstd * (g - g_mean - norm * g_norm_mean);
  }
}

// Channels [c_begin, c_end) of d loss / d weight and d loss / d bias, over
// N rows in order: dweight[c] += dout * norm, dbias[c] += dout. Rows are
// the outer loop so the CPU streams through memory.
// (layernorm_cpu.cc has a vectorized copy: keep the two in step.)
MUSTER_HD void LayerNormChannelsBackwardParams(float* dweight, float* dbias, const float* dout,
                                               const float* inp, const float* mean,
                                               const float* rstd, size_t N, int C, int c_begin,
                                               int c_end) {
  for (size_t row = 0; row < N; ++row) {
    const float* dout_row = dout + row * C;
    const float* inp_row = inp + row * C;
    for (int c = c_begin; c < c_end; ++c) {
      const float norm = (inp_row[c] - mean[row]) * rstd[row];
      dweight[c] += dout_row[c] * norm;
      dbias[c] += dout_row[c];
    }
  }
}

// ---- CPU back end (host pointers) ----
void LayerNormForwardCpu(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, size_t N, int C);
void LayerNormBackwardCpu(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, size_t N, int C);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int LayerNormForwardCuda(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, size_t N, int C, void* stream);
int LayerNormBackwardCuda(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, size_t N, int C, void* stream);

}  // namespace muster::kernels
