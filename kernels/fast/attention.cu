// Attention as GEMMs: for each sequence b, one batched GEMM over its NH
// heads per product. Head h of row t lives at qkv[(b T + t) 3C + h hs]
// (q; k at +C, v at +2C): in cuBLAS's column-major terms, head h's Q is
// an (hs, T) matrix with leading dimension 3C, and the next head is hs
// further on.
#include <cmath>

#include "kernels/fast/attention.h"
#include "kernels/fast/common.cuh"

namespace muster::kernels::fast {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row

// att[r, s] = softmax_s(scale * scores[r, s]) for s <= t, 0 for s > t, with
// t = r % T. Row r is (b, h, t) flattened.
template <typename T>
__global__ void SoftmaxForwardKernel(T* att, const float* scores, size_t rows, int Tn,
                                     float scale) {
  const size_t row = blockIdx.x * static_cast<size_t>(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int t = static_cast<int>(row % Tn);
  const float* in = scores + row * Tn;
  T* out = att + row * Tn;
  float max_value = -INFINITY;
  for (int s = lane; s <= t; s += 32) max_value = fmaxf(max_value, in[s]);
  max_value = WarpMax(max_value) * scale;
  float sum = 0.0f;
  for (int s = lane; s <= t; s += 32) sum += expf(in[s] * scale - max_value);
  const float inv_sum = 1.0f / WarpSum(sum);
  for (int s = lane; s < Tn; s += 32) {
    out[s] = FromFloat<T>(s <= t ? expf(in[s] * scale - max_value) * inv_sum : 0.0f);
  }
}

// In place over att: dscores[s] = scale * att[s] (datt[s] - sum_j att[j]
// datt[j]), 0 above the diagonal (where att is 0).
template <typename T>
__global__ void SoftmaxBackwardKernel(T* att, const float* datt, size_t rows, int Tn,
                                      float scale) {
  const size_t row = blockIdx.x * static_cast<size_t>(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int t = static_cast<int>(row % Tn);
  T* p = att + row * Tn;
  const float* g = datt + row * Tn;
  float dot = 0.0f;
  for (int s = lane; s <= t; s += 32) dot += ToFloat(p[s]) * g[s];
  dot = WarpSum(dot);
  // Every lane has read its p[s] above before the sum, and writes only
  // its own s below.
  for (int s = lane; s < Tn; s += 32) {
    p[s] = FromFloat<T>(s <= t ? scale * ToFloat(p[s]) * (g[s] - dot) : 0.0f);
  }
}

// One batched GEMM per sequence: `call` is set up for sequence 0, and
// `step_*` moves each operand to the next sequence.
int PerSequence(Gemm& gemm, LtCall call, int B, long long step_a, long long step_b,
                long long step_d, size_t a_bytes, size_t b_bytes, size_t d_bytes) {
  for (int b = 0; b < B; ++b) {
    LtCall c = call;
    c.a = static_cast<const char*>(call.a) + b * step_a * a_bytes;
    c.b = static_cast<const char*>(call.b) + b * step_b * b_bytes;
    c.d = static_cast<char*>(call.d) + b * step_d * d_bytes;
    const int status = gemm.Run(c);
    if (status != 0) return status;
  }
  return 0;
}

}  // namespace

int AttentionForward(Gemm& gemm, void* out, void* att, float* scores, const void* qkv, int B,
                     int T, int C, int NH) {
  const int hs = C / NH;
  const size_t act = ActBytes(gemm.act());
  const char* q = static_cast<const char*>(qkv);
  const long long TT = static_cast<long long>(T) * T;
  // scores^T of head h (T_s, T_t) = K_h^T (stored (hs, T_s)) @ Q_h (hs, T_t):
  // column t of the result is row t of scores, so scores is row-major.
  LtCall s;
  s.trans_a = true;
  s.m = T;
  s.n = T;
  s.k = hs;
  s.a = q + C * act;
  s.lda = 3 * C;
  s.stride_a = hs;
  s.b = q;
  s.ldb = 3 * C;
  s.stride_b = hs;
  s.d = scores;
  s.ldd = T;
  s.stride_d = TT;
  s.d_fp32 = true;
  s.batch = NH;
  int status = PerSequence(gemm, s, B, 3LL * T * C, 3LL * T * C, NH * TT, act, act, 4);
  if (status != 0) return status;

  const size_t rows = static_cast<size_t>(B) * NH * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  status = Dispatch(gemm.act(), [&](auto tag) {
    using Tp = decltype(tag);
    SoftmaxForwardKernel<Tp><<<CeilDiv(rows, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                               AsStream(gemm.stream())>>>(static_cast<Tp*>(att), scores, rows,
                                                           T, scale);
    return LaunchStatus();
  });
  if (status != 0) return status;

  // out_h (hs, T_t) = V_h (hs, T_s) @ att_h^T (stored (T_s, T_t): att row t
  // is column t).
  LtCall o;
  o.m = hs;
  o.n = T;
  o.k = T;
  o.a = q + 2 * C * act;
  o.lda = 3 * C;
  o.stride_a = hs;
  o.b = att;
  o.ldb = T;
  o.stride_b = TT;
  o.d = out;
  o.ldd = C;
  o.stride_d = hs;
  o.batch = NH;
  return PerSequence(gemm, o, B, 3LL * T * C, NH * TT, static_cast<long long>(T) * C, act, act,
                     act);
}

int AttentionBackward(Gemm& gemm, void* dqkv, float* datt, void* att, const void* dout,
                      const void* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const size_t act = ActBytes(gemm.act());
  const char* q = static_cast<const char*>(qkv);
  char* dq = static_cast<char*>(dqkv);
  const long long TT = static_cast<long long>(T) * T;
  const long long qkv_step = 3LL * T * C, out_step = static_cast<long long>(T) * C;

  // dV_h (hs, T_s) = dout_h (hs, T_t) @ att_h (stored (T_s, T_t), transposed).
  LtCall dv;
  dv.trans_b = true;
  dv.m = hs;
  dv.n = T;
  dv.k = T;
  dv.a = dout;
  dv.lda = C;
  dv.stride_a = hs;
  dv.b = att;
  dv.ldb = T;
  dv.stride_b = TT;
  dv.d = dq + 2 * C * act;
  dv.ldd = 3 * C;
  dv.stride_d = hs;
  dv.batch = NH;
  int status = PerSequence(gemm, dv, B, out_step, NH * TT, qkv_step, act, act, act);
  if (status != 0) return status;

  // datt^T (T_s, T_t) = V_h^T (stored (hs, T_s)) @ dout_h (hs, T_t): datt
  // row-major, like the scores.
  LtCall da;
  da.trans_a = true;
  da.m = T;
  da.n = T;
  da.k = hs;
  da.a = q + 2 * C * act;
  da.lda = 3 * C;
  da.stride_a = hs;
  da.b = dout;
  da.ldb = C;
  da.stride_b = hs;
  da.d = datt;
  da.ldd = T;
  da.stride_d = TT;
  da.d_fp32 = true;
  da.batch = NH;
  status = PerSequence(gemm, da, B, qkv_step, out_step, NH * TT, act, act, 4);
  if (status != 0) return status;

  const size_t rows = static_cast<size_t>(B) * NH * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  status = Dispatch(gemm.act(), [&](auto tag) {
    using Tp = decltype(tag);
    SoftmaxBackwardKernel<Tp><<<CeilDiv(rows, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                AsStream(gemm.stream())>>>(static_cast<Tp*>(att), datt, rows, T,
                                                            scale);
    return LaunchStatus();
  });
  if (status != 0) return status;
  // att now holds dscores (row t: d loss / d scores[t, :]).

  // dQ_h (hs, T_t) = K_h (hs, T_s) @ dscores^T (stored (T_s, T_t)).
  LtCall dqc;
  dqc.m = hs;
  dqc.n = T;
  dqc.k = T;
  dqc.a = q + C * act;
  dqc.lda = 3 * C;
  dqc.stride_a = hs;
  dqc.b = att;
  dqc.ldb = T;
  dqc.stride_b = TT;
  dqc.d = dq;
  dqc.ldd = 3 * C;
  dqc.stride_d = hs;
  dqc.batch = NH;
  status = PerSequence(gemm, dqc, B, qkv_step, NH * TT, qkv_step, act, act, act);
  if (status != 0) return status;

  // dK_h (hs, T_s) = Q_h (hs, T_t) @ dscores (stored (T_s, T_t), transposed).
  LtCall dk;
  dk.trans_b = true;
  dk.m = hs;
  dk.n = T;
  dk.k = T;
  dk.a = q;
  dk.lda = 3 * C;
  dk.stride_a = hs;
  dk.b = att;
  dk.ldb = T;
  dk.stride_b = TT;
  dk.d = dq + C * act;
  dk.ldd = 3 * C;
  dk.stride_d = hs;
  dk.batch = NH;
  return PerSequence(gemm, dk, B, qkv_step, NH * TT, qkv_step, act, act, act);
}

}  // namespace muster::kernels::fast
