// Token + position embedding, as llm.c's encoder_forward / encoder_backward:
//   out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]
// Shapes: B batch, T time (T <= maxT), C channels, Vp padded vocabulary.
//   tokens (B, T) int32, each in [0, Vp); wte (Vp, C); wpe (maxT, C) (only
//   its first T rows are read); out (B, T, C).
//
// Backward ACCUMULATES (+=) into dwte and dwpe (see matmul.h). Several
// positions may carry the same token, so the split is by channel: each
// thread owns a range of channels and walks the positions in order, which
// keeps the sums race-free and their order fixed.
// Aliasing: outputs must not alias inputs.
#pragma once

#include <cstddef>

#include "kernels/hd.h"

namespace muster::kernels {

// One position: out_row (C) = wte_row (C) + wpe_row (C).
MUSTER_HD void EncoderRowForward(float* out_row, const float* wte_row, const float* wpe_row,
                                 int C) {
  for (int c = 0; c < C; ++c) out_row[c] = wte_row[c] + wpe_row[c];
}

// Channels [c_begin, c_end) of dwte (Vp, C) and dwpe (maxT, C), from
// dout (B, T, C), positions in (b, t) order.
MUSTER_HD void EncoderChannelsBackward(float* dwte, float* dwpe, const float* dout,
                                       const int* tokens, int B, int T, int C, int c_begin,
                                       int c_end) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const size_t row = static_cast<size_t>(b) * T + t;
      const float* dout_row = dout + row * C;
      float* dwte_row = dwte + static_cast<size_t>(tokens[row]) * C;
      for (int c = c_begin; c < c_end; ++c) dwte_row[c] += dout_row[c];
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int c = c_begin; c < c_end; ++c) {
      float sum = 0.0f;
      for (int b = 0; b < B; ++b) sum += dout[(static_cast<size_t>(b) * T + t) * C + c];
      dwpe[static_cast<size_t>(t) * C + c] += sum;
    }
  }
}

// ---- CPU back end (host pointers) ----
void EncoderForwardCpu(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                       int T, int C);
void EncoderBackwardCpu(float* dwte, float* dwpe, const float* dout, const int* tokens, int B,
                        int T, int C);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int EncoderForwardCuda(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, void* stream);
int EncoderBackwardCuda(float* dwte, float* dwpe, const float* dout, const int* tokens, int B,
                        int T, int C, void* stream);

}  // namespace muster::kernels
