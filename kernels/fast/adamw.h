// AdamW fused with the bf16 cast of the weights: one pass updates the fp32
// master weights and moments and writes the bf16 copy the GEMMs read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/adamw.h"

namespace muster::kernels::fast {

// kernels/adamw.h's update of params, m, v (n) fp32 from grads (n) fp32;
// params_bf16 (n, raw bf16 bits) gets the new params rounded to nearest
// even, unless it is nullptr.
int AdamWUpdate(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                size_t n, const AdamWHyper& hyper, int step, void* stream);

// out (n, raw bf16 bits) = in (n) fp32 rounded to nearest even.
int CastToBf16(uint16_t* out, const float* in, size_t n, void* stream);

}  // namespace muster::kernels::fast
