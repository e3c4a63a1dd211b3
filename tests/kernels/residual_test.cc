#include "kernels/residual.h"

#include <vector>

#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::Dot;
using testing::FiniteDifferenceGradient;
using testing::RandomFloats;
using testing::RequireClose;
using testing::ToDouble;

constexpr size_t kCount = 2 * 5 * 8;  // B=2, T=5, C=8

std::vector<double> ReferenceForward(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

TEST_CASE("residual forward adds, in place too") {
  auto a = RandomFloats(kCount, 1), b = RandomFloats(kCount, 2);
  std::vector<float> out(kCount);
  ResidualForwardCpu(out.data(), a.data(), b.data(), kCount);
  // float addition of two floats is exactly rounded; so is the reference.
  std::vector<double> want(kCount);
  for (size_t i = 0; i < kCount; ++i) want[i] = static_cast<float>(a[i] + b[i]);
  RequireClose(out, want, 0, 0, "out");
  ResidualForwardCpu(a.data(), a.data(), b.data(), kCount);
  REQUIRE(BitwiseEqual(a, out));
}

TEST_CASE("residual backward matches finite differences and accumulates") {
  auto a = RandomFloats(kCount, 3), b = RandomFloats(kCount, 4);
  auto dout = RandomFloats(kCount, 5);
  const auto a_d = ToDouble(a), b_d = ToDouble(b);
  const float prior = 0.125f;
  std::vector<float> da(kCount, prior), db(kCount, prior);
  ResidualBackwardCpu(da.data(), db.data(), dout.data(), kCount);
  auto want_da = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) { return Dot(ReferenceForward(x, b_d), dout); }, a_d);
  auto want_db = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) { return Dot(ReferenceForward(a_d, x), dout); }, b_d);
  for (double& g : want_da) g += prior;
  for (double& g : want_db) g += prior;
  RequireClose(da, want_da, 1e-6, 1e-7, "dinp1");
  RequireClose(db, want_db, 1e-6, 1e-7, "dinp2");
}

TEST_CASE("residual is bitwise deterministic") {
  const size_t n = 100000;
  auto a = RandomFloats(n, 6), b = RandomFloats(n, 7), dout = RandomFloats(n, 8);
  auto run = [&] {
    std::vector<float> out(n), da(n, 0.0f), db(n, 0.0f);
    ResidualForwardCpu(out.data(), a.data(), b.data(), n);
    ResidualBackwardCpu(da.data(), db.data(), dout.data(), n);
    out.insert(out.end(), da.begin(), da.end());
    out.insert(out.end(), db.begin(), db.end());
    return out;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
