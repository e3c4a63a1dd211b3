// bf16 (bfloat16: fp32's sign, 8-bit exponent and top 7 mantissa bits) as
// raw 16-bit patterns, for the host and the device alike: FSDP gathers
// parameters in bf16 on either back end (worker/strategy/fsdp/fsdp.h), so
// the CPU must round exactly as CUDA's __float2bfloat16_rn does.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/hd.h"

namespace muster::kernels {

// x rounded to the nearest bf16, ties to even. Values beyond bf16's range
// round to infinity, as in IEEE arithmetic; a NaN stays a NaN (0x7fff,
// CUDA's canonical bf16 NaN).
MUSTER_HD uint16_t Bf16FromFloat(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  // Add half an ulp of the result, plus one if the kept part is odd, and
  // truncate: round to nearest, ties to even. A carry into the exponent is
  // the correct rounding too (up to the next binade, or to infinity).
  const uint32_t odd = (bits >> 16) & 1u;
  bits += 0x7fffu + odd;
  return static_cast<uint16_t>(bits >> 16);
}

// The fp32 whose top half is `h`: exact.
MUSTER_HD float FloatFromBf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace muster::kernels
