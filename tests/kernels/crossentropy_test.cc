#include "kernels/crossentropy.h"

#include <cmath>
#include <vector>

#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::FiniteDifferenceGradient;
using testing::RandomFloats;
using testing::RequireClose;
using testing::ToDouble;

constexpr size_t N = 10;  // B=2, T=5 rows
constexpr int V = 11, Vp = 16;
const std::vector<int> kTargets = {0, 10, 3, 3, 7, 1, 10, 5, 9, 2};

// Logits in [-3, 3], with a large padded tail: were the padding read, it
// would dominate the softmax.
std::vector<float> MakeLogits(unsigned seed) {
  auto logits = RandomFloats(N * Vp, seed, -3.0f, 3.0f);
  for (size_t row = 0; row < N; ++row) {
    for (int v = V; v < Vp; ++v) logits[row * Vp + v] = 40.0f + v;
  }
  return logits;
}

// Per-row loss from the definition, in double, ignoring columns >= V.
std::vector<double> ReferenceLosses(const std::vector<double>& logits) {
  std::vector<double> losses(N);
  for (size_t row = 0; row < N; ++row) {
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(logits[row * Vp + v]);
    losses[row] = std::log(sum) - logits[row * Vp + kTargets[row]];
  }
  return losses;
}

TEST_CASE("cross-entropy loss matches the log-sum-exp reference") {
  auto logits = MakeLogits(1);
  std::vector<float> losses(N), lse(N);
  CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), kTargets.data(), N, V, Vp);
  const auto want = ReferenceLosses(ToDouble(logits));
  RequireClose(losses, want, 1e-5, 1e-6, "losses");
  std::vector<double> want_lse(N);
  for (size_t row = 0; row < N; ++row) want_lse[row] = want[row] + logits[row * Vp + kTargets[row]];
  RequireClose(lse, want_lse, 1e-6, 1e-6, "lse");
}

TEST_CASE("cross-entropy survives logits that would overflow expf") {
  std::vector<float> logits(Vp, 0.0f);
  logits[0] = 200.0f;
  logits[1] = 199.0f;
  float lse = 0;
  const float loss = CrossEntropyRowForward(&lse, logits.data(), V, 1);
  REQUIRE(std::isfinite(loss));
  REQUIRE(loss == Approx(1.0 + std::log1p(std::exp(-1.0))).epsilon(1e-5));
}

TEST_CASE("cross-entropy backward matches finite differences, zero in padding") {
  auto logits = MakeLogits(2);
  const float dloss = 1.0f / N;  // the gradient of a mean over positions
  std::vector<float> losses(N), lse(N);
  CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), kTargets.data(), N, V, Vp);
  std::vector<float> dlogits(N * Vp, 123.0f);  // stale contents are overwritten
  CrossEntropyBackwardCpu(dlogits.data(), logits.data(), lse.data(), kTargets.data(), dloss, N, V,
                          Vp);

  auto want = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) {
        double total = 0;
        for (double loss : ReferenceLosses(x)) total += dloss * loss;
        return total;
      },
      ToDouble(logits));
  RequireClose(dlogits, want, 1e-4, 1e-6, "dlogits");
  for (size_t row = 0; row < N; ++row) {
    for (int v = V; v < Vp; ++v) REQUIRE(dlogits[row * Vp + v] == 0.0f);
  }

  SECTION("in place over the logits gives the same gradient") {
    std::vector<float> in_place = logits;
    CrossEntropyBackwardCpu(in_place.data(), in_place.data(), lse.data(), kTargets.data(), dloss, N,
                            V, Vp);
    REQUIRE(BitwiseEqual(in_place, dlogits));
  }
}

TEST_CASE("cross-entropy is bitwise deterministic") {
  const size_t rows = 64;
  const int vocab = 1000, padded = 1024;
  auto logits = RandomFloats(rows * padded, 3, -5.0f, 5.0f);
  std::vector<int> targets(rows);
  for (size_t row = 0; row < rows; ++row) targets[row] = (row * 37) % vocab;
  auto run = [&] {
    std::vector<float> losses(rows), lse(rows), dlogits(rows * padded);
    CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), targets.data(), rows, vocab,
                           padded);
    CrossEntropyBackwardCpu(dlogits.data(), logits.data(), lse.data(), targets.data(), 0.01f, rows,
                            vocab, padded);
    losses.insert(losses.end(), lse.begin(), lse.end());
    losses.insert(losses.end(), dlogits.begin(), dlogits.end());
    return losses;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
