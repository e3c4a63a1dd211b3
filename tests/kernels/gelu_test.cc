#include "kernels/gelu.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

namespace muster::kernels {
namespace {

// Reference in double precision, written from the definition.
double GeluReference(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST_CASE("ExpNonPositive is within 2^-23 relative of e^w on [-87, 0]") {
  // Every 2^-10 over the whole range softmax and cross-entropy use.
  for (double w = -87.0; w <= 0.0; w += 1.0 / 1024) {
    const float x = static_cast<float>(w);
    const double want = std::exp(double{x});
    INFO("w = " << w);
    REQUIRE(std::fabs(ExpNonPositive(x) - want) <= 0x1p-23 * want);
  }
  REQUIRE(ExpNonPositive(0.0f) == 1.0f);
  REQUIRE(ExpNonPositive(-1000.0f) == ExpNonPositive(-87.0f));  // clamped, not 0
}

TEST_CASE("gelu forward matches the double-precision definition") {
  for (double x = -6.0; x <= 6.0; x += 0.125) {
    REQUIRE(GeluForwardElem(static_cast<float>(x)) == Approx(GeluReference(x)).margin(1e-6));
  }
}

TEST_CASE("gelu's tanh and sech^2 are within float rounding of double") {
  // Every 2^-12 on [-12, 12], where tanh goes from -1 to 1 in float.
  for (double u = -12.0; u <= 12.0; u += 1.0 / 4096) {
    const float x = static_cast<float>(u);
    const GeluTanhSech got = GeluTanhAndSechSq(x);
    const double cosh_x = std::cosh(double{x});
    INFO("u = " << u);
    // Absolute: gelu uses 1 + tanh. 2^-23 is 2 ulps of tanh near 1.
    REQUIRE(std::fabs(got.tanh_u - std::tanh(double{x})) <= 0x1p-23);
    // Relative: sech^2 is tiny where |u| is large.
    REQUIRE(std::fabs(got.sech_sq * cosh_x * cosh_x - 1.0) <= 1e-6);
  }
}

TEST_CASE("gelu backward matches central finite differences") {
  const double h = 1e-4;
  for (double x = -5.0; x <= 5.0; x += 0.25) {
    double numeric = (GeluReference(x + h) - GeluReference(x - h)) / (2 * h);
    REQUIRE(GeluBackwardElem(static_cast<float>(x), 1.0f) == Approx(numeric).margin(1e-5));
    REQUIRE(GeluBackwardElem(static_cast<float>(x), -2.5f) == Approx(-2.5 * numeric).margin(1e-4));
  }
}

TEST_CASE("cpu loops apply the element math, in place too") {
  std::vector<float> in = {-3.0f, -0.5f, 0.0f, 0.5f, 3.0f};
  std::vector<float> out(in.size());
  GeluForwardCpu(out.data(), in.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) REQUIRE(out[i] == GeluForwardElem(in[i]));

  std::vector<float> grad(in.size(), 1.0f);
  GeluBackwardCpu(grad.data(), in.data(), grad.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) REQUIRE(grad[i] == GeluBackwardElem(in[i], 1.0f));

  // In place over the input (a zero-bubble pipeline keeps dfch in fch).
  std::vector<float> pre = in, dout = {0.5f, -1.0f, 2.0f, 0.25f, -0.75f};
  GeluBackwardCpu(pre.data(), pre.data(), dout.data(), pre.size());
  for (size_t i = 0; i < in.size(); ++i) REQUIRE(pre[i] == GeluBackwardElem(in[i], dout[i]));

  GeluForwardCpu(in.data(), in.data(), in.size());
  REQUIRE(in == out);
  GeluForwardCpu(nullptr, nullptr, 0);  // empty input is a no-op
}

}  // namespace
}  // namespace muster::kernels
