#include "kernels/cpu_parallel.h"
#include "kernels/encoder.h"

namespace muster::kernels {

void EncoderForwardCpu(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                       int T, int C) {
  cpu::ParallelFor(static_cast<long>(B) * T, [=](long row) {
    EncoderRowForward(out + row * C, wte + static_cast<size_t>(tokens[row]) * C,
                      wpe + (row % T) * C, C);
  });
}

void EncoderBackwardCpu(float* dwte, float* dwpe, const float* dout, const int* tokens, int B,
                        int T, int C) {
  cpu::ParallelForChannelRanges(C, [=](int begin, int end) {
    EncoderChannelsBackward(dwte, dwpe, dout, tokens, B, T, C, begin, end);
  });
}

}  // namespace muster::kernels
