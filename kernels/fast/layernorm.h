// LayerNorm of the fused engine, with the residual add before it fused in
// (llm.c's fused_residual_forward): one pass makes the block's residual
// stream and the next LayerNorm's input. Statistics are fp32; eps and the
// formula are kernels/layernorm.h's.
#pragma once

#include <cstddef>

#include "kernels/fast/fast.h"
#include "kernels/fast/gemm.h"

namespace muster::kernels::fast {

// With inp2: residual (N, C) = inp1 + inp2 (rounded to the act type), and
// out (N, C) = LayerNorm(residual). Without (inp2 == nullptr): out =
// LayerNorm(inp1), residual unused. mean, rstd (N) fp32 for the backward.
// weight, bias (C) fp32. Activations act-typed.
int LayerNormForward(ActType act, void* out, float* mean, float* rstd, void* residual,
                     const void* inp1, const void* inp2, const float* weight, const float* bias,
                     int N, int C, void* stream);

// dinp (N, C) act += the input gradient from dout (N, C) act; dweight,
// dbias (C) fp32 += the parameter gradients (= with kOverwrite), summed
// over rows in a fixed order. inp is the forward's input (the residual).
// scratch: LayerNormBackwardScratchFloats(N, C) floats. With `defer`, the
// parameter gradients' second pass joins that batch (kernels/fast/gemm.h)
// instead of running now, and scratch must stay untouched until it runs.
int LayerNormBackward(ActType act, void* dinp, float* dweight, float* dbias, GradWrite write,
                      const void* dout, const void* inp, const float* weight, const float* mean,
                      const float* rstd, int N, int C, float* scratch, void* stream,
                      ColumnSumsBatch* defer = nullptr);
size_t LayerNormBackwardScratchFloats(int N, int C);

}  // namespace muster::kernels::fast
