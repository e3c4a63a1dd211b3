#include "kernels/layernorm.h"

#include <cmath>
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

constexpr size_t N = 10;  // B=2, T=5 rows
constexpr int C = 8;

struct Reference {
  std::vector<double> out, mean, rstd;
};

// inp (N, C), weight and bias (C), from the definition in double.
Reference ReferenceForward(const std::vector<double>& inp, const std::vector<double>& weight,
                           const std::vector<double>& bias) {
  Reference ref{std::vector<double>(N * C), std::vector<double>(N), std::vector<double>(N)};
  for (size_t row = 0; row < N; ++row) {
    double mean = 0;
    for (int c = 0; c < C; ++c) mean += inp[row * C + c] / C;
    double var = 0;
    for (int c = 0; c < C; ++c) {
      var += (inp[row * C + c] - mean) * (inp[row * C + c] - mean) / C;
    }
    const double rstd = 1.0 / std::sqrt(var + 1e-5);
    for (int c = 0; c < C; ++c) {
      ref.out[row * C + c] = (inp[row * C + c] - mean) * rstd * weight[c] + bias[c];
    }
    ref.mean[row] = mean;
    ref.rstd[row] = rstd;
  }
  return ref;
}

TEST_CASE("layernorm forward matches the definition and saves mean, rstd") {
  auto inp = RandomFloats(N * C, 1, -2.0f, 3.0f);
  auto weight = RandomFloats(C, 2, 0.5f, 1.5f);
  auto bias = RandomFloats(C, 3);
  std::vector<float> out(N * C), mean(N), rstd(N);
  LayerNormForwardCpu(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(),
                      N, C);
  Reference ref = ReferenceForward(ToDouble(inp), ToDouble(weight), ToDouble(bias));
  RequireClose(out, ref.out, 1e-5, 1e-5, "out");
  RequireClose(mean, ref.mean, 1e-5, 1e-6, "mean");
  RequireClose(rstd, ref.rstd, 1e-5, 1e-6, "rstd");
}

TEST_CASE("layernorm backward matches finite differences and accumulates") {
  auto inp = RandomFloats(N * C, 4, -2.0f, 3.0f);
  auto weight = RandomFloats(C, 5, 0.5f, 1.5f);
  auto bias = RandomFloats(C, 6);
  auto dout = RandomFloats(N * C, 7);
  const auto inp_d = ToDouble(inp), weight_d = ToDouble(weight), bias_d = ToDouble(bias);

  std::vector<float> out(N * C), mean(N), rstd(N);
  LayerNormForwardCpu(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(),
                      N, C);
  const float prior = -0.5f;
  std::vector<float> dinp(N * C, prior), dweight(C, prior), dbias(C, prior);
  LayerNormBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                       weight.data(), mean.data(), rstd.data(), N, C);

  auto want_dinp = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) {
        return Dot(ReferenceForward(x, weight_d, bias_d).out, dout);
      },
      inp_d);
  auto want_dweight = FiniteDifferenceGradient(
      [&](const std::vector<double>& w) {
        return Dot(ReferenceForward(inp_d, w, bias_d).out, dout);
      },
      weight_d);
  auto want_dbias = FiniteDifferenceGradient(
      [&](const std::vector<double>& b) {
        return Dot(ReferenceForward(inp_d, weight_d, b).out, dout);
      },
      bias_d);
  for (auto* grad : {&want_dinp, &want_dweight, &want_dbias}) {
    for (double& g : *grad) g += prior;
  }
  RequireClose(dinp, want_dinp, 1e-4, 2e-5, "dinp");
  RequireClose(dweight, want_dweight, 1e-4, 2e-5, "dweight");
  RequireClose(dbias, want_dbias, 1e-4, 2e-5, "dbias");
}

TEST_CASE("layernorm is bitwise deterministic") {
  const size_t rows = 300;
  const int channels = 64;
  auto inp = RandomFloats(rows * channels, 8);
  auto weight = RandomFloats(channels, 9);
  auto bias = RandomFloats(channels, 10);
  auto dout = RandomFloats(rows * channels, 11);
  auto run = [&] {
    std::vector<float> out(rows * channels), mean(rows), rstd(rows), dinp(rows * channels, 0.0f),
        dweight(channels, 0.0f), dbias(channels, 0.0f);
    LayerNormForwardCpu(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                        bias.data(), rows, channels);
    LayerNormBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                         weight.data(), mean.data(), rstd.data(), rows, channels);
    for (auto* part : {&mean, &rstd, &dinp, &dweight, &dbias}) {
      out.insert(out.end(), part->begin(), part->end());
    }
    return out;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
