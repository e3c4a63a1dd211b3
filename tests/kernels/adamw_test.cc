#include "kernels/adamw.h"

#include <cmath>
#include <vector>

#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::RandomFloats;
using testing::RequireClose;

TEST_CASE("adamw first step matches the hand computation") {
  // m = 0.1 * 0.5 = 0.05, v = 0.001 * 0.25 = 2.5e-4; bias-corrected they
  // are 0.5 and 0.25, so the Adam direction is 0.5 / sqrt(0.25) = 1.
  AdamWHyper hyper;
  hyper.learning_rate = 0.1f;
  hyper.beta1 = 0.9f;
  hyper.beta2 = 0.999f;
  hyper.eps = 1e-8f;
  hyper.weight_decay = 0.01f;
  std::vector<float> params = {1.0f, 1.0f}, m(2, 0.0f), v(2, 0.0f);
  std::vector<float> grads = {0.5f, 0.5f};
  AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), 2, hyper, 1);
  REQUIRE(m[0] == Approx(0.05).epsilon(1e-6));
  // 1 - 0.999f is 0.001 only to about 5e-5 in float.
  REQUIRE(v[0] == Approx(2.5e-4).epsilon(1e-4));
  // param -= 0.1 * (1 + 0.01 * 1)
  REQUIRE(params[0] == Approx(0.899).epsilon(1e-6));

  SECTION("no weight decay when the caller passes zero") {
    hyper.weight_decay = 0.0f;
    std::vector<float> plain = {1.0f}, m0 = {0.0f}, v0 = {0.0f};
    AdamWUpdateCpu(plain.data(), m0.data(), v0.data(), grads.data(), 1, hyper, 1);
    REQUIRE(plain[0] == Approx(0.9).epsilon(1e-6));
  }
}

TEST_CASE("adamw decay is decoupled from the gradient") {
  AdamWHyper hyper;
  hyper.learning_rate = 0.5f;
  hyper.weight_decay = 0.1f;
  // A zero gradient leaves m = v = 0, so only the decay moves the param.
  std::vector<float> params = {2.0f, -4.0f}, m(2, 0.0f), v(2, 0.0f), grads(2, 0.0f);
  AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), 2, hyper, 1);
  REQUIRE(params[0] == Approx(2.0 * (1 - 0.05)).epsilon(1e-7));
  REQUIRE(params[1] == Approx(-4.0 * (1 - 0.05)).epsilon(1e-7));
  hyper.weight_decay = 0.0f;
  AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), 2, hyper, 2);
  REQUIRE(params[0] == Approx(1.9).epsilon(1e-7));
}

TEST_CASE("adamw over several steps matches a double-precision reference") {
  const size_t n = 50;
  AdamWHyper hyper;
  hyper.learning_rate = 1e-2f;
  hyper.beta1 = 0.9f;
  hyper.beta2 = 0.95f;
  hyper.eps = 1e-8f;
  hyper.weight_decay = 0.1f;
  auto params = RandomFloats(n, 1);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  std::vector<double> want_params(params.begin(), params.end()), want_m(n, 0), want_v(n, 0);
  for (int step = 1; step <= 5; ++step) {
    auto grads = RandomFloats(n, 100 + step);
    AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), n, hyper, step);
    const double b1 = hyper.beta1, b2 = hyper.beta2;
    for (size_t i = 0; i < n; ++i) {
      want_m[i] = b1 * want_m[i] + (1 - b1) * grads[i];
      want_v[i] = b2 * want_v[i] + (1 - b2) * grads[i] * grads[i];
      const double m_hat = want_m[i] / (1 - std::pow(b1, step));
      const double v_hat = want_v[i] / (1 - std::pow(b2, step));
      want_params[i] -= double{hyper.learning_rate} * (m_hat / (std::sqrt(v_hat) + hyper.eps) +
                                                       double{hyper.weight_decay} * want_params[i]);
    }
  }
  RequireClose(params, want_params, 1e-5, 1e-6, "params");
  RequireClose(m, want_m, 1e-5, 1e-7, "m");
  RequireClose(v, want_v, 1e-5, 1e-8, "v");
}

TEST_CASE("adamw is bitwise deterministic") {
  const size_t n = 100000;
  auto start = RandomFloats(n, 2);
  auto grads = RandomFloats(n, 3);
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  auto run = [&] {
    std::vector<float> params = start, m(n, 0.0f), v(n, 0.0f);
    for (int step = 1; step <= 3; ++step) {
      AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), n, hyper, step);
    }
    params.insert(params.end(), m.begin(), m.end());
    params.insert(params.end(), v.begin(), v.end());
    return params;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
