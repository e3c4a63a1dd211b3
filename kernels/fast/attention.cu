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
__global__ void SoftmaxBackwardKernel(T* att, const float* datt, size_t rows, int Tn, float scale) {
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

// One operand of the per-head products, in elements of `bytes` each: head
// h of sequence b starts at base + b * sequence + h * head, and its rows
// (cuBLAS's columns) are `ld` apart.
struct Operand {
  const void* base;
  int ld;
  long long head;
  long long sequence;
  size_t bytes;
  const void* At(int b) const { return static_cast<const char*>(base) + b * sequence * bytes; }
};

// D_h (m, n) = op(A_h) op(B_h) for every head h of every sequence: one
// batched GEMM (over the heads) per sequence, since the heads' stride is
// not the sequences'. D is fp32 if d.bytes is 4 and the act type is bf16.
int PerHead(Gemm& gemm, bool trans_a, bool trans_b, int m, int n, int k, const Operand& a,
            const Operand& b, const Operand& d, int B, int NH) {
  LtCall call;
  call.trans_a = trans_a;
  call.trans_b = trans_b;
  call.m = m;
  call.n = n;
  call.k = k;
  call.lda = a.ld;
  call.stride_a = a.head;
  call.ldb = b.ld;
  call.stride_b = b.head;
  call.ldd = d.ld;
  call.stride_d = d.head;
  call.d_fp32 = d.bytes == 4;
  call.batch = NH;
  for (int s = 0; s < B; ++s) {
    call.a = a.At(s);
    call.b = b.At(s);
    call.d = const_cast<void*>(d.At(s));
    const int status = gemm.Run(call);
    if (status != 0) return status;
  }
  return 0;
}

}  // namespace

int AttentionForward(Gemm& gemm, void* out, void* att, float* scores, const void* qkv, int B, int T,
                     int C, int NH) {
  const int hs = C / NH;
  const size_t act = ActBytes(gemm.act());
  const char* q = static_cast<const char*>(qkv);
  const long long TT = static_cast<long long>(T) * T;
  const Operand query{q, 3 * C, hs, 3LL * T * C, act};
  const Operand key{q + C * act, 3 * C, hs, 3LL * T * C, act};
  const Operand value{q + 2 * C * act, 3 * C, hs, 3LL * T * C, act};
  const Operand score{scores, T, TT, NH * TT, sizeof(float)};
  const Operand prob{att, T, TT, NH * TT, act};
  const Operand output{out, C, hs, static_cast<long long>(T) * C, act};

  // scores^T of head h (T_s, T_t) = K_h^T (stored (hs, T_s)) @ Q_h (hs, T_t):
  // column t of the result is row t of scores, so scores is row-major.
  int status = PerHead(gemm, true, false, T, T, hs, key, query, score, B, NH);
  if (status != 0) return status;

  const size_t rows = static_cast<size_t>(B) * NH * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  status = Dispatch(gemm.act(), [&](auto tag) {
    using Tp = decltype(tag);
    LaunchKernel<SoftmaxForwardKernel<Tp>>(CeilDiv(rows, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                           AsStream(gemm.stream()), static_cast<Tp*>(att), scores,
                                           rows, T, scale);
    return LaunchStatus();
  });
  if (status != 0) return status;

  // out_h (hs, T_t) = V_h (hs, T_s) @ att_h^T (stored (T_s, T_t): att row t
  // is column t).
  return PerHead(gemm, false, false, hs, T, T, value, prob, output, B, NH);
}

int AttentionBackward(Gemm& gemm, void* dqkv, float* datt, void* att, const void* dout,
                      const void* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const size_t act = ActBytes(gemm.act());
  const char* q = static_cast<const char*>(qkv);
  char* dq = static_cast<char*>(dqkv);
  const long long TT = static_cast<long long>(T) * T;
  const long long qkv_step = 3LL * T * C, out_step = static_cast<long long>(T) * C;
  const Operand query{q, 3 * C, hs, qkv_step, act};
  const Operand key{q + C * act, 3 * C, hs, qkv_step, act};
  const Operand value{q + 2 * C * act, 3 * C, hs, qkv_step, act};
  const Operand dquery{dq, 3 * C, hs, qkv_step, act};
  const Operand dkey{dq + C * act, 3 * C, hs, qkv_step, act};
  const Operand dvalue{dq + 2 * C * act, 3 * C, hs, qkv_step, act};
  const Operand doutput{dout, C, hs, out_step, act};
  const Operand prob{att, T, TT, NH * TT, act};  // then the scores' gradient
  const Operand dprob{datt, T, TT, NH * TT, sizeof(float)};

  // dV_h (hs, T_s) = dout_h (hs, T_t) @ att_h (stored (T_s, T_t), transposed).
  int status = PerHead(gemm, false, true, hs, T, T, doutput, prob, dvalue, B, NH);
  if (status != 0) return status;
  // datt^T (T_s, T_t) = V_h^T (stored (hs, T_s)) @ dout_h (hs, T_t): datt
  // row-major, like the scores.
  status = PerHead(gemm, true, false, T, T, hs, value, doutput, dprob, B, NH);
  if (status != 0) return status;

  const size_t rows = static_cast<size_t>(B) * NH * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  status = Dispatch(gemm.act(), [&](auto tag) {
    using Tp = decltype(tag);
    LaunchKernel<SoftmaxBackwardKernel<Tp>>(CeilDiv(rows, kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                            AsStream(gemm.stream()), static_cast<Tp*>(att), datt,
                                            rows, T, scale);
    return LaunchStatus();
  });
  if (status != 0) return status;
  // att now holds dscores (row t: d loss / d scores[t, :]).

  // dQ_h (hs, T_t) = K_h (hs, T_s) @ dscores^T (stored (T_s, T_t)).
  status = PerHead(gemm, false, false, hs, T, T, key, prob, dquery, B, NH);
  if (status != 0) return status;
  // dK_h (hs, T_s) = Q_h (hs, T_t) @ dscores (stored (T_s, T_t), transposed).
  return PerHead(gemm, false, true, hs, T, T, query, prob, dkey, B, NH);
}

}  // namespace muster::kernels::fast
