// Causal multi-head self-attention of the fused engine, as batched cuBLASLt
// GEMMs over the heads of each sequence plus row softmax kernels (llm.c's
// attention without cuDNN). The (T, T) score matrix of every head is
// materialised: the probabilities are kept for the backward pass.
//
// qkv (B, T, 3C) act: per row [q | k | v], each C = NH heads of hs = C/NH.
// Scores are scaled by 1/sqrt(hs); position t attends to 0..t.
#pragma once

#include "kernels/fast/gemm.h"

namespace muster::kernels::fast {

// out (B, T, C) act: the heads' outputs side by side.
// att (B, NH, T, T) act: the probabilities, exactly zero above the
//   diagonal; kept for AttentionBackward.
// scores (B, NH, T, T) fp32: scratch.
int AttentionForward(Gemm& gemm, void* out, void* att, float* scores, const void* qkv, int B, int T,
                     int C, int NH);

// dqkv (B, T, 3C) act, overwritten, from dout (B, T, C) act.
// datt (B, NH, T, T) fp32: scratch. att is consumed: overwritten with the
// gradient of the scores.
int AttentionBackward(Gemm& gemm, void* dqkv, float* datt, void* att, const void* dout,
                      const void* qkv, int B, int T, int C, int NH);

}  // namespace muster::kernels::fast
