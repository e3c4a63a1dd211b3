#include "kernels/attention.h"
#include "kernels/cpu_parallel.h"

namespace muster::kernels {

// Each loop runs over the B*NH*T (batch, head, position) rows; a row's
// writes touch only its own slice of the outputs (see attention.h).

void AttentionForwardCpu(float* out, float* att, const float* qkv, int B, int T,
                         int C, int NH) {
  const int hs = C / NH;
  cpu::ParallelFor(static_cast<long>(B) * NH * T, [=](long row) {
    const int b = static_cast<int>(row / (static_cast<long>(NH) * T));
    const int h = static_cast<int>((row / T) % NH);
    const int t = static_cast<int>(row % T);
    AttentionRowForward(out + AttentionOutOffset(b, h, T, C, hs),
                        att + AttentionMapOffset(b, h, NH, T),
                        qkv + AttentionQkvOffset(b, h, T, C, hs), t, T, C, hs);
  });
}

void AttentionBackwardCpu(float* dqkv, float* dpreatt, const float* dout,
                          const float* qkv, const float* att, int B, int T,
                          int C, int NH) {
  const int hs = C / NH;
  const long rows = static_cast<long>(B) * NH * T;
  cpu::ParallelFor(rows, [=](long row) {
    const int b = static_cast<int>(row / (static_cast<long>(NH) * T));
    const int h = static_cast<int>((row / T) % NH);
    const int t = static_cast<int>(row % T);
    const size_t map = AttentionMapOffset(b, h, NH, T);
    AttentionRowBackwardScores(
        dpreatt + map, att + map, qkv + AttentionQkvOffset(b, h, T, C, hs),
        dout + AttentionOutOffset(b, h, T, C, hs), t, T, C, hs);
  });
  // Pass 2 reads dpreatt rows that other threads wrote in pass 1; the
  // parallel loop above ends in a barrier, which orders them.
  cpu::ParallelFor(rows, [=](long row) {
    const int b = static_cast<int>(row / (static_cast<long>(NH) * T));
    const int h = static_cast<int>((row / T) % NH);
    const int t = static_cast<int>(row % T);
    const size_t map = AttentionMapOffset(b, h, NH, T);
    const size_t qkv_offset = AttentionQkvOffset(b, h, T, C, hs);
    AttentionRowBackwardInputs(
        dqkv + qkv_offset, dpreatt + map, att + map, qkv + qkv_offset,
        dout + AttentionOutOffset(b, h, T, C, hs), t, T, C, hs);
  });
}

}  // namespace muster::kernels
