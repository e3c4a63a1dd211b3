// Helpers for the kernel tests: seeded random tensors, a double-precision
// central finite-difference gradient, and element-wise comparison.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace muster::kernels::testing {

inline std::vector<float> RandomFloats(size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

inline std::vector<double> ToDouble(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// d objective / d x by central differences, all in double. The objective is
// usually sum(reference_forward(x) * upstream), whose gradient is exactly
// what a backward pass given dout = upstream must produce.
inline std::vector<double> FiniteDifferenceGradient(
    const std::function<double(const std::vector<double>&)>& objective, std::vector<double> x,
    double step = 1e-5) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + step;
    const double up = objective(x);
    x[i] = saved - step;
    const double down = objective(x);
    x[i] = saved;
    grad[i] = (up - down) / (2 * step);
  }
  return grad;
}

inline double Dot(const std::vector<double>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

// Every element within rel * |want| + abs of the reference; the message
// names the first element that is not.
inline void RequireClose(const std::vector<float>& got, const std::vector<double>& want, double rel,
                         double abs, const char* what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    REQUIRE(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs);
  }
}

inline bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace muster::kernels::testing
