// e^w for w <= 0, the exponential of GELU, softmax and cross-entropy: both
// back ends run it. Why not expf: libm's expf is a call per element, so
// the CPU loops around it stay scalar (it was 2% of a training step in
// perf); this one is branch- and call-free and vectorizes. Cephes' expf:
// Cody-Waite reduction to |r| <= ln2 / 2 and a degree-7 polynomial.
// Accuracy against double: tests/kernels/gelu_test.cc.
#pragma once

#include <cstring>

#include "kernels/hd.h"

namespace muster::kernels {

// w below -87 is taken as -87 (e^-87 ~ 1.6e-38), so 2^n stays normal.
MUSTER_HD float ExpNonPositive(float w) {
  w = w > -87.0f ? w : -87.0f;  // ternaries, not fmaxf: they vectorize
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
  const float round_magic = 12582912.0f;
  const float n = (w * 1.44269504088896341f + round_magic) - round_magic;
  const float r = (w - n * 0.693359375f) - n * -2.12194440e-4f;  // w - n ln2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float exp_r = p * r * r + r + 1.0f;
  // 2^n from its exponent bits; n is in [-126, 0], a normal float.
  const int bits = (static_cast<int>(n) + 127) << 23;
  float two_to_n;
  memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return exp_r * two_to_n;
}

}  // namespace muster::kernels
