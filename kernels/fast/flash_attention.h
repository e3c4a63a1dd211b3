// Causal flash attention for bf16 with head size 64 (GPT-2's): the scores
// never leave the chip. Tiles of 64 queries by 64 keys go through the
// tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulation) with
// an online softmax; tiles above the diagonal are skipped. The backward
// recomputes the probabilities from the saved log-sum-exp.
//
// Deterministic without atomics: the backward runs as two kernels, one
// per key tile (dK, dV: sums over queries) and one per query tile (dQ:
// sums over keys), each adding its terms in a fixed order.
//
// Layout as attention.h: qkv (B, T, 3C) bf16, out (B, T, C) bf16, with
// NH heads of hs = C / NH = 64. Other shapes and fp32 storage use
// attention.h's GEMM path.
#pragma once

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

constexpr int kFlashHeadSize = 64;

// Whether the flash kernels handle this precision and shape.
inline bool FlashAttentionSupports(ActType act, int C, int NH) {
  return act == ActType::kBf16 && NH > 0 && C % NH == 0 && C / NH == kFlashHeadSize;
}

// out (B, T, C) bf16; lse (B, NH, T) fp32: each row's log2-sum-exp of the
// scaled scores, for the backward.
int FlashAttentionForward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH,
                          void* stream);

// dqkv (B, T, 3C) bf16, overwritten, from dout (B, T, C). out and lse are
// the forward's. delta (B, NH, T) fp32: scratch.
int FlashAttentionBackward(void* dqkv, float* delta, const void* dout, const void* out,
                           const void* qkv, const float* lse, int B, int T, int C, int NH,
                           void* stream);

}  // namespace muster::kernels::fast
