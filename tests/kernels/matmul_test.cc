#include "kernels/matmul.h"

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

constexpr size_t BT = 10;  // B=2, T=5
constexpr int C = 8;
constexpr int OC = 12;

// out (BT, OC) = inp (BT, C) @ weight^T + bias, from the definition.
std::vector<double> ReferenceForward(const std::vector<double>& inp,
                                     const std::vector<double>& weight,
                                     const std::vector<double>& bias) {
  std::vector<double> out(BT * OC);
  for (size_t row = 0; row < BT; ++row) {
    for (int o = 0; o < OC; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (int c = 0; c < C; ++c) sum += inp[row * C + c] * weight[o * C + c];
      out[row * OC + o] = sum;
    }
  }
  return out;
}

TEST_CASE("matmul forward matches the definition, with and without bias") {
  auto inp = RandomFloats(BT * C, 1);
  auto weight = RandomFloats(OC * C, 2);
  auto bias = RandomFloats(OC, 3);
  std::vector<float> out(BT * OC, 99.0f);  // stale contents are overwritten

  MatmulForwardCpu(out.data(), inp.data(), weight.data(), bias.data(), BT, C, OC);
  RequireClose(out, ReferenceForward(ToDouble(inp), ToDouble(weight), ToDouble(bias)), 1e-5, 1e-6,
               "with bias");

  MatmulForwardCpu(out.data(), inp.data(), weight.data(), nullptr, BT, C, OC);
  RequireClose(out, ReferenceForward(ToDouble(inp), ToDouble(weight), {}), 1e-5, 1e-6,
               "without bias");
}

TEST_CASE("matmul backward matches finite differences and accumulates") {
  auto inp = RandomFloats(BT * C, 4);
  auto weight = RandomFloats(OC * C, 5);
  auto bias = RandomFloats(OC, 6);
  auto dout = RandomFloats(BT * OC, 7);
  const auto inp_d = ToDouble(inp), weight_d = ToDouble(weight), bias_d = ToDouble(bias);

  // Gradients start at a known non-zero value to check they accumulate.
  const float prior = 0.25f;
  std::vector<float> dinp(BT * C, prior), dweight(OC * C, prior), dbias(OC, prior);
  MatmulBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                    weight.data(), BT, C, OC);

  auto want_dinp = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) {
        return Dot(ReferenceForward(x, weight_d, bias_d), dout);
      },
      inp_d);
  auto want_dweight = FiniteDifferenceGradient(
      [&](const std::vector<double>& w) { return Dot(ReferenceForward(inp_d, w, bias_d), dout); },
      weight_d);
  auto want_dbias = FiniteDifferenceGradient(
      [&](const std::vector<double>& b) { return Dot(ReferenceForward(inp_d, weight_d, b), dout); },
      bias_d);
  for (double& g : want_dinp) g += prior;
  for (double& g : want_dweight) g += prior;
  for (double& g : want_dbias) g += prior;
  RequireClose(dinp, want_dinp, 1e-4, 1e-5, "dinp");
  RequireClose(dweight, want_dweight, 1e-4, 1e-5, "dweight");
  RequireClose(dbias, want_dbias, 1e-4, 1e-5, "dbias");
}

TEST_CASE("matmul backward skips dinp and dbias when given nullptr") {
  auto inp = RandomFloats(BT * C, 8);
  auto weight = RandomFloats(OC * C, 9);
  auto dout = RandomFloats(BT * OC, 10);
  std::vector<float> with_all(OC * C, 0.0f), weight_only(OC * C, 0.0f);
  std::vector<float> dinp(BT * C, 0.0f), dbias(OC, 0.0f);
  MatmulBackwardCpu(dinp.data(), with_all.data(), dbias.data(), dout.data(), inp.data(),
                    weight.data(), BT, C, OC);
  MatmulBackwardCpu(nullptr, weight_only.data(), nullptr, dout.data(), inp.data(), weight.data(),
                    BT, C, OC);
  REQUIRE(BitwiseEqual(with_all, weight_only));
}

TEST_CASE("matmul is bitwise deterministic") {
  // Larger than the accuracy tests so OpenBLAS and OpenMP split the work.
  const size_t rows = 256;
  const int in = 96, outc = 80;
  auto inp = RandomFloats(rows * in, 11);
  auto weight = RandomFloats(outc * in, 12);
  auto bias = RandomFloats(outc, 13);
  auto dout = RandomFloats(rows * outc, 14);
  auto run = [&] {
    std::vector<float> out(rows * outc), dinp(rows * in, 0.0f), dweight(outc * in, 0.0f),
        dbias(outc, 0.0f);
    MatmulForwardCpu(out.data(), inp.data(), weight.data(), bias.data(), rows, in, outc);
    MatmulBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                      weight.data(), rows, in, outc);
    out.insert(out.end(), dinp.begin(), dinp.end());
    out.insert(out.end(), dweight.begin(), dweight.end());
    out.insert(out.end(), dbias.begin(), dbias.end());
    return out;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
