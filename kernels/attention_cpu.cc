#include <algorithm>

#include "kernels/attention.h"
#include "kernels/cpu_gemm.h"
#include "kernels/cpu_parallel.h"

namespace muster::kernels {
namespace {

// One task per (b, h): its GEMMs run single-threaded inside the task, and
// its writes touch only its own slices of the outputs (see attention.h), so
// the bits do not depend on the thread count.
//
// Causal masking: the products are split into blocks of kBlock query rows
// (forward, dq) or key columns (dk, dv), each multiplying only the part of
// the (T, T) map that is not masked, up to the block's edge. Masked entries
// inside a block are exact zeros in att and dpreatt, so they add nothing.
constexpr int kBlock = 64;

// The rows between the products, [first, last) of one (b, h)'s (T, T)
// map, in clones so that their loops use the widest vectors there are.
MUSTER_CPU_CLONES void SoftmaxRows(float* head_att, int first, int last, int T) {
  for (int t = first; t < last; ++t) {
    AttentionSoftmaxRow(head_att + static_cast<size_t>(t) * T, t, T);
  }
}

MUSTER_CPU_CLONES void ScoreGradRows(float* head_dpreatt, const float* head_att, int first,
                                     int last, int T) {
  for (int t = first; t < last; ++t) {
    AttentionScoreGradRow(head_dpreatt + static_cast<size_t>(t) * T,
                          head_att + static_cast<size_t>(t) * T, t, T);
  }
}

template <typename Fn>
void ForEachHead(int B, int NH, Fn fn) {
  cpu::UseSingleThreadedBlas();
  const int heads = B * NH;
#pragma omp parallel for schedule(dynamic, 1)
  for (int task = 0; task < heads; ++task) fn(task / NH, task % NH);
}

}  // namespace

void AttentionForwardCpu(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  ForEachHead(B, NH, [=](int b, int h) {
    const float* q = qkv + AttentionQkvOffset(b, h, T, C, hs);   // (T, hs)
    const float* k = q + C;                                      // (T, hs)
    const float* v = q + 2 * C;                                  // (T, hs)
    float* head_out = out + AttentionOutOffset(b, h, T, C, hs);  // (T, hs)
    float* head_att = att + AttentionMapOffset(b, h, NH, T);     // (T, T)
    for (int row = 0; row < T; row += kBlock) {
      const int rows = std::min(kBlock, T - row);
      const int keys = row + rows;  // rows [row, row + rows) see keys < keys
      float* att_rows = head_att + static_cast<size_t>(row) * T;
      // att[rows, :keys] = scale * q[rows] (rows, hs) @ k[:keys]^T (hs, keys)
      cpu::Sgemm(false, true, rows, keys, hs, scale, q + static_cast<size_t>(row) * 3 * C, 3 * C, k,
                 3 * C, 0.0f, att_rows, T);
      SoftmaxRows(head_att, row, row + rows, T);
      // out[rows] = att[rows, :keys] (rows, keys) @ v[:keys] (keys, hs)
      cpu::Sgemm(false, false, rows, hs, keys, 1.0f, att_rows, T, v, 3 * C, 0.0f,
                 head_out + static_cast<size_t>(row) * C, C);
    }
  });
}

void AttentionBackwardCpu(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  ForEachHead(B, NH, [=](int b, int h) {
    const size_t qkv_offset = AttentionQkvOffset(b, h, T, C, hs);
    const size_t map = AttentionMapOffset(b, h, NH, T);
    const float* q = qkv + qkv_offset;  // (T, hs) each, rows 3C apart
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* dq = dqkv + qkv_offset;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* head_dout = dout + AttentionOutOffset(b, h, T, C, hs);
    const float* head_att = att + map;    // (T, T)
    float* head_dpreatt = dpreatt + map;  // (T, T)
    const int ld = 3 * C;

    // Pass 1, by query rows: dpreatt, then dq, which needs only these rows.
    for (int row = 0; row < T; row += kBlock) {
      const int rows = std::min(kBlock, T - row);
      const int keys = row + rows;
      float* dpreatt_rows = head_dpreatt + static_cast<size_t>(row) * T;
      // datt[rows, :keys] = dout[rows] (rows, hs) @ v[:keys]^T (hs, keys)
      cpu::Sgemm(false, true, rows, keys, hs, 1.0f, head_dout + static_cast<size_t>(row) * C, C, v,
                 ld, 0.0f, dpreatt_rows, T);
      ScoreGradRows(head_dpreatt, head_att, row, row + rows, T);
      // dq[rows] += scale * dpreatt[rows, :keys] (rows, keys) @ k[:keys]
      cpu::Sgemm(false, false, rows, hs, keys, scale, dpreatt_rows, T, k, ld, 1.0f,
                 dq + static_cast<size_t>(row) * ld, ld);
    }
    // Pass 2, by key columns: key t2 is seen by queries t1 >= t2, so the
    // block [col, col + cols) needs rows [col, T).
    for (int col = 0; col < T; col += kBlock) {
      const int cols = std::min(kBlock, T - col);
      const int queries = T - col;
      const size_t corner = static_cast<size_t>(col) * T + col;
      // dk[cols] += scale * dpreatt[col:, cols]^T (cols, queries) @ q[col:]
      cpu::Sgemm(true, false, cols, hs, queries, scale, head_dpreatt + corner, T,
                 q + static_cast<size_t>(col) * ld, ld, 1.0f, dk + static_cast<size_t>(col) * ld,
                 ld);
      // dv[cols] += att[col:, cols]^T (cols, queries) @ dout[col:]
      cpu::Sgemm(true, false, cols, hs, queries, 1.0f, head_att + corner, T,
                 head_dout + static_cast<size_t>(col) * C, C, 1.0f,
                 dv + static_cast<size_t>(col) * ld, ld);
    }
  });
}

}  // namespace muster::kernels
