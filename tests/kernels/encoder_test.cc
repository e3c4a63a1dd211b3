#include "kernels/encoder.h"

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

constexpr int B = 2, T = 5, C = 8, Vp = 16, kMaxT = 7;
// Token 3 appears three times and 0 twice, so dwte rows must sum.
const std::vector<int> kTokens = {3, 0, 9, 3, 15, 0, 3, 7, 1, 10};

std::vector<double> ReferenceForward(const std::vector<double>& wte,
                                     const std::vector<double>& wpe) {
  std::vector<double> out(B * T * C);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      for (int c = 0; c < C; ++c) {
        out[(b * T + t) * C + c] = wte[kTokens[b * T + t] * C + c] + wpe[t * C + c];
      }
    }
  }
  return out;
}

TEST_CASE("encoder forward adds token and position embeddings") {
  auto wte = RandomFloats(Vp * C, 1), wpe = RandomFloats(kMaxT * C, 2);
  std::vector<float> out(B * T * C);
  EncoderForwardCpu(out.data(), kTokens.data(), wte.data(), wpe.data(), B, T, C);
  auto want = ReferenceForward(ToDouble(wte), ToDouble(wpe));
  for (double& w : want) w = static_cast<float>(w);  // one float add: exact
  RequireClose(out, want, 0, 0, "out");
}

TEST_CASE("encoder backward matches finite differences and accumulates") {
  auto wte = RandomFloats(Vp * C, 3), wpe = RandomFloats(kMaxT * C, 4);
  auto dout = RandomFloats(B * T * C, 5);
  const auto wte_d = ToDouble(wte), wpe_d = ToDouble(wpe);
  const float prior = 0.5f;
  std::vector<float> dwte(Vp * C, prior), dwpe(kMaxT * C, prior);
  EncoderBackwardCpu(dwte.data(), dwpe.data(), dout.data(), kTokens.data(), B, T, C);
  auto want_dwte = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) { return Dot(ReferenceForward(x, wpe_d), dout); }, wte_d);
  auto want_dwpe = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) { return Dot(ReferenceForward(wte_d, x), dout); }, wpe_d);
  for (double& g : want_dwte) g += prior;
  for (double& g : want_dwpe) g += prior;
  RequireClose(dwte, want_dwte, 1e-5, 1e-6, "dwte");
  // Rows of wpe beyond T are untouched (stay at prior).
  RequireClose(dwpe, want_dwpe, 1e-5, 1e-6, "dwpe");
}

TEST_CASE("encoder is bitwise deterministic") {
  const int batch = 4, time = 64, channels = 72, vocab = 50;
  std::vector<int> tokens(batch * time);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7 + i / 5) % vocab;
  auto wte = RandomFloats(vocab * channels, 6), wpe = RandomFloats(time * channels, 7);
  auto dout = RandomFloats(batch * time * channels, 8);
  auto run = [&] {
    std::vector<float> out(batch * time * channels), dwte(vocab * channels, 0.0f),
        dwpe(time * channels, 0.0f);
    EncoderForwardCpu(out.data(), tokens.data(), wte.data(), wpe.data(), batch, time, channels);
    EncoderBackwardCpu(dwte.data(), dwpe.data(), dout.data(), tokens.data(), batch, time, channels);
    out.insert(out.end(), dwte.begin(), dwte.end());
    out.insert(out.end(), dwpe.begin(), dwpe.end());
    return out;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
