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

TEST_CASE("gelu forward matches the double-precision definition") {
  for (double x = -6.0; x <= 6.0; x += 0.125) {
    REQUIRE(GeluForwardElem(static_cast<float>(x)) ==
            Approx(GeluReference(x)).margin(1e-6));
  }
}

TEST_CASE("gelu backward matches central finite differences") {
  const double h = 1e-4;
  for (double x = -5.0; x <= 5.0; x += 0.25) {
    double numeric = (GeluReference(x + h) - GeluReference(x - h)) / (2 * h);
    REQUIRE(GeluBackwardElem(static_cast<float>(x), 1.0f) ==
            Approx(numeric).margin(1e-5));
    REQUIRE(GeluBackwardElem(static_cast<float>(x), -2.5f) ==
            Approx(-2.5 * numeric).margin(1e-4));
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

  GeluForwardCpu(in.data(), in.data(), in.size());
  REQUIRE(in == out);
  GeluForwardCpu(nullptr, nullptr, 0);  // empty input is a no-op
}

}  // namespace
}  // namespace muster::kernels
