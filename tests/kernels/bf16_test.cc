// kernels/bf16.h against a reference that rounds by comparing distances in
// double: the two bf16 neighbours of x and the nearer one (the even one on
// a tie), on every class of fp32 bit pattern.
#include "kernels/bf16.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

namespace muster::kernels {
namespace {

float FromBits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

uint32_t BitsOf(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// The correctly rounded bf16 of a finite or infinite x, by distance.
uint16_t Reference(float x) {
  const uint32_t bits = BitsOf(x);
  const uint16_t down = static_cast<uint16_t>(bits >> 16);  // towards zero
  if ((bits & 0xffffu) == 0) return down;                   // exact (incl. infinities)
  const uint16_t up = static_cast<uint16_t>(down + 1);      // away from zero; may be infinity
  const double to_down = std::fabs(static_cast<double>(x) - FromBits(uint32_t{down} << 16));
  // Beyond the largest bf16, the step to "infinity" is the step to 2^128.
  const double up_value = (up & 0x7fffu) == 0x7f80u
                              ? std::copysign(std::ldexp(1.0, 128), static_cast<double>(x))
                              : static_cast<double>(FromBits(uint32_t{up} << 16));
  const double to_up = std::fabs(static_cast<double>(x) - up_value);
  if (to_down < to_up) return down;
  if (to_up < to_down) return up;
  return (down & 1u) == 0 ? down : up;
}

TEST_CASE("Bf16FromFloat rounds to nearest, ties to even, on random bit patterns") {
  std::mt19937 rng(20261124);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = any_bits(rng);
    const float x = FromBits(bits);
    if (std::isnan(x)) continue;
    INFO("bits " << std::hex << bits);
    REQUIRE(Bf16FromFloat(x) == Reference(x));
  }
}

TEST_CASE("Bf16FromFloat on the edge cases") {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1: exact
      {0x3f808000u, 0x3f80},  // a tie below an even mantissa: down
      {0x3f818000u, 0x3f82},  // a tie below an odd one: up
      {0x3f808001u, 0x3f81},  // just above the tie: up
      {0x3f807fffu, 0x3f80},  // just below: down
      {0xbf818000u, 0xbf82},  // negative: the same, mirrored
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0 keeps its sign
      {0x00000001u, 0x0000},  // the smallest denormal rounds to 0
      {0x00008000u, 0x0000},  // a denormal tie: to even (0)
      {0x00018000u, 0x0002},  // a denormal tie: to even (2)
      {0x7f7fffffu, 0x7f80},  // the largest float: beyond bf16's, to infinity
      {0x7f7f7fffu, 0x7f7f},  // just below the halfway point: the largest bf16
      {0x7f800000u, 0x7f80},  // +infinity
      {0xff800000u, 0xff80},  // -infinity
      {0x3fffffffu, 0x4000},  // a carry into the exponent
  };
  for (const Case& c : cases) {
    INFO("in " << std::hex << c.in);
    CHECK(Bf16FromFloat(FromBits(c.in)) == c.out);
    CHECK(Bf16FromFloat(FromBits(c.in)) == Reference(FromBits(c.in)));
  }
  // NaN stays NaN, whatever its payload (one that rounding would carry
  // into infinity included).
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffc00000u, 0x7f80ffffu}) {
    INFO("nan " << std::hex << nan);
    CHECK(std::isnan(FloatFromBf16(Bf16FromFloat(FromBits(nan)))));
  }
}

TEST_CASE("FloatFromBf16 is exact, and rounding a bf16 value gives it back") {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float x = FloatFromBf16(static_cast<uint16_t>(h));
    CHECK(BitsOf(x) == h << 16);
    if (!std::isnan(x)) CHECK(Bf16FromFloat(x) == h);
  }
}

}  // namespace
}  // namespace muster::kernels
