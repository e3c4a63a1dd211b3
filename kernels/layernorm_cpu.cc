#include "kernels/cpu_parallel.h"
#include "kernels/layernorm.h"

namespace muster::kernels {

void LayerNormForwardCpu(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, size_t N,
                         int C) {
  cpu::ParallelFor(static_cast<long>(N), [=](long row) {
    LayerNormRowForward(out + row * C, mean + row, rstd + row, inp + row * C,
                        weight, bias, C);
  });
}

void LayerNormBackwardCpu(float* dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp,
                          const float* weight, const float* mean,
                          const float* rstd, size_t N, int C) {
  cpu::ParallelFor(static_cast<long>(N), [=](long row) {
    LayerNormRowBackwardInput(dinp + row * C, dout + row * C, inp + row * C,
                              weight, mean[row], rstd[row], C);
  });
  cpu::ParallelForChannelRanges(C, [=](int begin, int end) {
    LayerNormChannelsBackwardParams(dweight, dbias, dout, inp, mean, rstd, N, C,
                                    begin, end);
  });
}

}  // namespace muster::kernels
