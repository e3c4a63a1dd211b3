// The CPU back end runs the shared row math (the MUSTER_HD functions) in
// vectorized clones: AVX-512, AVX2 or SSE2, whichever the machine has. This
// file is compiled without OpenMP, so here the same functions run as plain
// scalar code, as a GPU thread runs them. The two must agree to the bit:
// the sums have a fixed order (LaneSum) and no clone contracts to FMA.
#include <vector>

#include "kernels/crossentropy.h"
#include "kernels/layernorm.h"
#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::RandomFloats;

// Odd sizes, so every loop has a tail past its last full vector.
constexpr size_t N = 45;
constexpr int C = 77;

TEST_CASE("layernorm rows give the bits of the scalar row math") {
  auto inp = RandomFloats(N * C, 1, -3.0f, 3.0f), weight = RandomFloats(C, 2),
       bias = RandomFloats(C, 3), dout = RandomFloats(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N), dinp(N * C, 0.25f), dweight(C, 0.0f),
      dbias(C, 0.0f);
  LayerNormForwardCpu(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(),
                      N, C);
  LayerNormBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                       weight.data(), mean.data(), rstd.data(), N, C);
  std::vector<float> want_out(N * C), want_mean(N), want_rstd(N), want_dinp(N * C, 0.25f);
  for (size_t row = 0; row < N; ++row) {
    LayerNormRowForward(&want_out[row * C], &want_mean[row], &want_rstd[row], &inp[row * C],
                        weight.data(), bias.data(), C);
    LayerNormRowBackwardInput(&want_dinp[row * C], &dout[row * C], &inp[row * C], weight.data(),
                              want_mean[row], want_rstd[row], C);
  }
  REQUIRE(BitwiseEqual(out, want_out));
  REQUIRE(BitwiseEqual(mean, want_mean));
  REQUIRE(BitwiseEqual(rstd, want_rstd));
  REQUIRE(BitwiseEqual(dinp, want_dinp));
}

TEST_CASE("cross-entropy rows give the bits of the scalar row math") {
  const int V = 201, Vp = 208;
  auto logits = RandomFloats(N * Vp, 5, -6.0f, 6.0f);
  std::vector<int> targets(N);
  for (size_t i = 0; i < N; ++i) targets[i] = (i * 31) % V;
  std::vector<float> losses(N), lse(N), dlogits(N * Vp);
  CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
  CrossEntropyBackwardCpu(dlogits.data(), logits.data(), lse.data(), targets.data(), 0.125f, N, V,
                          Vp);
  std::vector<float> want_losses(N), want_lse(N), want_dlogits(N * Vp);
  for (size_t row = 0; row < N; ++row) {
    want_losses[row] = CrossEntropyRowForward(&want_lse[row], &logits[row * Vp], V, targets[row]);
    for (int v = 0; v < Vp; ++v) {
      want_dlogits[row * Vp + v] =
          CrossEntropyBackwardElem(logits[row * Vp + v], want_lse[row], v, V, targets[row], 0.125f);
    }
  }
  REQUIRE(BitwiseEqual(losses, want_losses));
  REQUIRE(BitwiseEqual(lse, want_lse));
  REQUIRE(BitwiseEqual(dlogits, want_dlogits));
}

}  // namespace
}  // namespace muster::kernels
