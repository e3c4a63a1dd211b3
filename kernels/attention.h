// Causal multi-head self-attention, as llm.c's attention_forward /
// attention_backward. B batch, T time, C channels, NH heads, hs = C / NH
// channels per head; scale = 1 / sqrt(hs).
// Shapes:
//   qkv, dqkv (B, T, 3C): query at channels [0, C), key at [C, 2C), value
//     at [2C, 3C); head h uses channels [h*hs, (h+1)*hs) of each.
//   out, dout (B, T, C): head h writes channels [h*hs, (h+1)*hs).
//   att (B, NH, T, T): softmax probabilities saved by the forward pass;
//     att[b,h,t,t2] is zero for t2 > t (the future is masked).
//   dpreatt (B, NH, T, T): backward scratch; contents on return unspecified.
// Memory: llm.c saves both preatt and att; we save att only, and the
// backward pass needs one (B, NH, T, T) scratch, which may be shared by
// all layers.
//
// Backward ACCUMULATES (+=) into dqkv (see matmul.h). It runs in two
// passes so that every output element has a single writer: first each
// query row's score gradient (into dpreatt), then each position's dq, dk
// and dv, which sum over the rows they appear in, in a fixed order.
// Aliasing: no output may alias an input. REQUIRES: C % NH == 0.
//
// Who runs what: the products (q k^T, att v and their backward) are GEMMs
// per (b, h); the CPU back end runs them on OpenBLAS, and the CUDA kernels
// run them as the per-row loops below. The softmax and its gradient, the
// rows between the products, are AttentionSoftmaxRow and
// AttentionScoreGradRow, which both back ends run. The per-row loops are
// tested on the CPU against the GEMM path (tests/kernels/attention_test.cc).
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/exp_math.h"
#include "kernels/hd.h"

namespace muster::kernels {

// Pointers for one (b, h): q(t) = qkv + t*3C, k(t) = q(t) + C, v(t) =
// q(t) + 2C, with qkv already offset to (b, 0, h*hs); dout(t) = dout +
// t*C, offset to (b, 0, h*hs); att and dpreatt offset to (b, h, 0, 0).
MUSTER_HD size_t AttentionQkvOffset(int b, int h, int T, int C, int hs) {
  return static_cast<size_t>(b) * T * 3 * C + static_cast<size_t>(h) * hs;
}
MUSTER_HD size_t AttentionOutOffset(int b, int h, int T, int C, int hs) {
  return static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hs;
}
MUSTER_HD size_t AttentionMapOffset(int b, int h, int NH, int T) {
  return (static_cast<size_t>(b) * NH + h) * T * T;
}

// Softmax of query row t, in place: att_row (T) holds the scaled scores
// q(t) . k(t2) * scale for t2 <= t on entry (later entries are ignored),
// and on return the probabilities, zero for t2 > t.
MUSTER_HD void AttentionSoftmaxRow(float* att_row, int t, int T) {
  float max_score = att_row[0];
  MUSTER_SIMD_MAX(max_score)
  for (int t2 = 1; t2 <= t; ++t2) {
    max_score = att_row[t2] > max_score ? att_row[t2] : max_score;
  }
  // Shifted by the max: every exponent is <= 0, so none can overflow.
  MUSTER_SIMD
  for (int t2 = 0; t2 <= t; ++t2) att_row[t2] = ExpNonPositive(att_row[t2] - max_score);
  float sum = 0.0f;  // in t2 order, on every back end
  for (int t2 = 0; t2 <= t; ++t2) sum += att_row[t2];
  const float inv_sum = 1.0f / sum;
  MUSTER_SIMD
  for (int t2 = 0; t2 <= t; ++t2) att_row[t2] *= inv_sum;
  for (int t2 = t + 1; t2 < T; ++t2) att_row[t2] = 0.0f;
}

// Gradient of query row t's pre-softmax scores, in place: dpreatt_row (T)
// holds datt[t, t2] = dout(t) . v(t2) for t2 <= t on entry (later entries
// are ignored), and on return dpreatt[t, t2] = att[t, t2] * (datt[t, t2] -
// sum_j att[t, j] * datt[t, j]), zero for t2 > t. att_row (T).
MUSTER_HD void AttentionScoreGradRow(float* dpreatt_row, const float* att_row, int t, int T) {
  float weighted_sum = 0.0f;
  for (int t2 = 0; t2 <= t; ++t2) weighted_sum += att_row[t2] * dpreatt_row[t2];
  MUSTER_SIMD
  for (int t2 = 0; t2 <= t; ++t2) {
    dpreatt_row[t2] = att_row[t2] * (dpreatt_row[t2] - weighted_sum);
  }
  for (int t2 = t + 1; t2 < T; ++t2) dpreatt_row[t2] = 0.0f;
}

// The per-row loops (the CUDA kernels' products; the CPU runs GEMMs).

// Query row t of one (b, h): writes att[t, :] (T) and out(t) (hs).
MUSTER_HD void AttentionRowForward(float* out, float* att, const float* qkv, int t, int T, int C,
                                   int hs) {
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const float* query = qkv + static_cast<size_t>(t) * 3 * C;
  float* att_row = att + static_cast<size_t>(t) * T;
  for (int t2 = 0; t2 <= t; ++t2) {
    const float* key = qkv + static_cast<size_t>(t2) * 3 * C + C;
    float score = 0.0f;
    for (int i = 0; i < hs; ++i) score += query[i] * key[i];
    att_row[t2] = score * scale;
  }
  AttentionSoftmaxRow(att_row, t, T);

  float* out_row = out + static_cast<size_t>(t) * C;
  for (int i = 0; i < hs; ++i) out_row[i] = 0.0f;
  for (int t2 = 0; t2 <= t; ++t2) {
    const float* value = qkv + static_cast<size_t>(t2) * 3 * C + 2 * C;
    for (int i = 0; i < hs; ++i) out_row[i] += att_row[t2] * value[i];
  }
}

// Pass 1, query row t of one (b, h): dpreatt[t, :] (see
// AttentionScoreGradRow).
MUSTER_HD void AttentionRowBackwardScores(float* dpreatt, const float* att, const float* qkv,
                                          const float* dout, int t, int T, int C, int hs) {
  float* dpreatt_row = dpreatt + static_cast<size_t>(t) * T;
  const float* dout_row = dout + static_cast<size_t>(t) * C;
  for (int t2 = 0; t2 <= t; ++t2) {
    const float* value = qkv + static_cast<size_t>(t2) * 3 * C + 2 * C;
    float datt = 0.0f;
    for (int i = 0; i < hs; ++i) datt += dout_row[i] * value[i];
    dpreatt_row[t2] = datt;
  }
  AttentionScoreGradRow(dpreatt_row, att + static_cast<size_t>(t) * T, t, T);
}

// Pass 2, position t of one (b, h): accumulates into dq(t), dk(t), dv(t)
// (dqkv offset like qkv):
//   dq(t) += scale * sum_{t2 <= t} dpreatt[t, t2] * k(t2)
//   dk(t) += scale * sum_{t1 >= t} dpreatt[t1, t] * q(t1)
//   dv(t) +=         sum_{t1 >= t} att[t1, t] * dout(t1)
MUSTER_HD void AttentionRowBackwardInputs(float* dqkv, const float* dpreatt, const float* att,
                                          const float* qkv, const float* dout, int t, int T, int C,
                                          int hs) {
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  float* dquery = dqkv + static_cast<size_t>(t) * 3 * C;
  float* dkey = dquery + C;
  float* dvalue = dquery + 2 * C;
  for (int t2 = 0; t2 <= t; ++t2) {
    const float weight = scale * dpreatt[static_cast<size_t>(t) * T + t2];
    const float* key = qkv + static_cast<size_t>(t2) * 3 * C + C;
    for (int i = 0; i < hs; ++i) dquery[i] += weight * key[i];
  }
  for (int t1 = t; t1 < T; ++t1) {
    const float key_weight = scale * dpreatt[static_cast<size_t>(t1) * T + t];
    const float value_weight = att[static_cast<size_t>(t1) * T + t];
    const float* query = qkv + static_cast<size_t>(t1) * 3 * C;
    const float* dout_row = dout + static_cast<size_t>(t1) * C;
    for (int i = 0; i < hs; ++i) {
      dkey[i] += key_weight * query[i];
      dvalue[i] += value_weight * dout_row[i];
    }
  }
}

// ---- CPU back end (host pointers) ----
void AttentionForwardCpu(float* out, float* att, const float* qkv, int B, int T, int C, int NH);
void AttentionBackwardCpu(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int AttentionForwardCuda(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                         void* stream);
int AttentionBackwardCuda(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH, void* stream);

}  // namespace muster::kernels
