#include "kernels/cpu_parallel.h"
#include "kernels/layernorm.h"

namespace muster::kernels {
namespace {

// LayerNormChannelsBackwardParams, vectorized across the channels: each
// channel still adds its rows in order, so the bits are the same.
MUSTER_CPU_CLONES void ChannelsBackwardParams(float* dweight, float* dbias, const float* dout,
                                              const float* inp, const float* mean,
                                              const float* rstd, long N, long C, int c_begin,
                                              int c_end) {
  for (long row = 0; row < N; ++row) {
    const float* dout_row = dout + row * C;
    const float* inp_row = inp + row * C;
    const float row_mean = mean[row], row_rstd = rstd[row];
#pragma omp simd
    for (int c = c_begin; c < c_end; ++c) {
      const float norm = (inp_row[c] - row_mean) * row_rstd;
      dweight[c] += dout_row[c] * norm;
      dbias[c] += dout_row[c];
    }
  }
}

// Rows [begin, end), in clones so that their loops use the widest vectors
// there are.
MUSTER_CPU_CLONES void ForwardRows(float* out, float* mean, float* rstd, const float* inp,
                                   const float* weight, const float* bias, long begin, long end,
                                   int C) {
  for (long row = begin; row < end; ++row) {
    LayerNormRowForward(out + row * C, mean + row, rstd + row, inp + row * C, weight, bias, C);
  }
}

MUSTER_CPU_CLONES void BackwardInputRows(float* dinp, const float* dout, const float* inp,
                                         const float* weight, const float* mean, const float* rstd,
                                         long begin, long end, int C) {
  for (long row = begin; row < end; ++row) {
    LayerNormRowBackwardInput(dinp + row * C, dout + row * C, inp + row * C, weight, mean[row],
                              rstd[row], C);
  }
}

}  // namespace

void LayerNormForwardCpu(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, size_t N, int C) {
  cpu::ParallelForBlocks(static_cast<long>(N), cpu::kRowsPerTask, [=](long begin, long end) {
    ForwardRows(out, mean, rstd, inp, weight, bias, begin, end, C);
  });
}

void LayerNormBackwardCpu(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, size_t N, int C) {
  cpu::ParallelForBlocks(static_cast<long>(N), cpu::kRowsPerTask, [=](long begin, long end) {
    BackwardInputRows(dinp, dout, inp, weight, mean, rstd, begin, end, C);
  });
  cpu::ParallelForChannelRanges(C, [=](int begin, int end) {
    ChannelsBackwardParams(dweight, dbias, dout, inp, mean, rstd, static_cast<long>(N), C, begin,
                           end);
  });
}

}  // namespace muster::kernels
