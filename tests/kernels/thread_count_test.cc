// The CPU back end promises more than run-to-run determinism: every
// reduction has a fixed order, so 1, 2 or 3 threads give the same bits.
// That includes the GEMMs: OpenBLAS runs single-threaded on tasks whose
// shapes do not depend on the thread count (kernels/cpu_gemm.h).
#include <omp.h>

#include <functional>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/crossentropy.h"
#include "kernels/encoder.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "kernels/residual.h"
#include "tests/kernels/test_util.h"

namespace muster::kernels {
namespace {

using testing::BitwiseEqual;
using testing::RandomFloats;

constexpr int B = 3, T = 37, C = 40, NH = 4, V = 101, Vp = 128;
constexpr size_t N = B * T;

// Runs `op` with 1, 2 and 3 threads and requires identical results.
void RequireSameForAnyThreadCount(const std::function<std::vector<float>()>& op) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto single = op();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    INFO(threads << " threads");
    REQUIRE(BitwiseEqual(single, op()));
  }
  omp_set_num_threads(saved);
}

void Append(std::vector<float>* all, const std::vector<float>& part) {
  all->insert(all->end(), part.begin(), part.end());
}

TEST_CASE("layernorm bits do not depend on the thread count") {
  auto inp = RandomFloats(N * C, 1), weight = RandomFloats(C, 2), bias = RandomFloats(C, 3);
  auto dout = RandomFloats(N * C, 4);
  RequireSameForAnyThreadCount([&] {
    std::vector<float> out(N * C), mean(N), rstd(N), dinp(N * C, 0.0f), dweight(C, 0.0f),
        dbias(C, 0.0f);
    LayerNormForwardCpu(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                        bias.data(), N, C);
    LayerNormBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                         weight.data(), mean.data(), rstd.data(), N, C);
    for (const auto* part : {&mean, &rstd, &dinp, &dweight, &dbias}) Append(&out, *part);
    return out;
  });
}

TEST_CASE("encoder and residual bits do not depend on the thread count") {
  std::vector<int> tokens(N);
  for (size_t i = 0; i < N; ++i) tokens[i] = (i * 13) % 20;  // many repeats
  auto wte = RandomFloats(Vp * C, 5), wpe = RandomFloats(T * C, 6);
  auto dout = RandomFloats(N * C, 7);
  RequireSameForAnyThreadCount([&] {
    std::vector<float> out(N * C), dwte(Vp * C, 0.0f), dwpe(T * C, 0.0f), da(N * C, 0.0f),
        db(N * C, 1.0f);
    EncoderForwardCpu(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    EncoderBackwardCpu(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    ResidualForwardCpu(out.data(), out.data(), dout.data(), N * C);
    ResidualBackwardCpu(da.data(), db.data(), dout.data(), N * C);
    for (const auto* part : {&dwte, &dwpe, &da, &db}) Append(&out, *part);
    return out;
  });
}

TEST_CASE("attention bits do not depend on the thread count") {
  auto qkv = RandomFloats(N * 3 * C, 8), dout = RandomFloats(N * C, 9);
  RequireSameForAnyThreadCount([&] {
    std::vector<float> out(N * C), att(B * NH * T * T), dpreatt(att.size()), dqkv(qkv.size(), 0.0f);
    AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
    AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                         NH);
    Append(&out, att);
    Append(&out, dqkv);
    return out;
  });
}

TEST_CASE("matmul bits do not depend on the thread count") {
  // More rows and output channels than one GEMM task holds.
  const int OC = 130;
  auto inp = RandomFloats(N * C, 13), weight = RandomFloats(OC * C, 14),
       bias = RandomFloats(OC, 15), dout = RandomFloats(N * OC, 16);
  RequireSameForAnyThreadCount([&] {
    std::vector<float> out(N * OC), dinp(N * C, 0.5f), dweight(OC * C, 0.5f), dbias(OC, 0.5f);
    MatmulForwardCpu(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    MatmulBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                      weight.data(), N, C, OC);
    for (const auto* part : {&dinp, &dweight, &dbias}) Append(&out, *part);
    return out;
  });
}

TEST_CASE("a GPT block's matmuls give the same bits with any thread count") {
  // GPT block shapes, split in row tasks of 512 (kernels/cpu_gemm.h). One
  // thread once ran GEMMs this large as one OpenBLAS call, which on an AMD
  // EPYC gave other bits than the tasks (OpenBLAS 0.3.21, Zen kernels).
  const int rows = 1024, in = 256, out = 768;
  auto inp = RandomFloats(rows * in, 17), weight = RandomFloats(out * in, 18),
       bias = RandomFloats(out, 19), dout = RandomFloats(rows * out, 20);
  RequireSameForAnyThreadCount([&] {
    std::vector<float> y(rows * out), dinp(rows * in, 0.5f), dweight(out * in, 0.5f),
        dbias(out, 0.5f);
    MatmulForwardCpu(y.data(), inp.data(), weight.data(), bias.data(), rows, in, out);
    MatmulBackwardCpu(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                      weight.data(), rows, in, out);
    for (const auto* part : {&dinp, &dweight, &dbias}) Append(&y, *part);
    return y;
  });
}

TEST_CASE("cross-entropy and adamw bits do not depend on the thread count") {
  auto logits = RandomFloats(N * Vp, 10, -4.0f, 4.0f);
  std::vector<int> targets(N);
  for (size_t i = 0; i < N; ++i) targets[i] = (i * 7) % V;
  auto start = RandomFloats(5000, 11), grads = RandomFloats(5000, 12);
  AdamWHyper hyper;
  hyper.weight_decay = 0.1f;
  RequireSameForAnyThreadCount([&] {
    std::vector<float> losses(N), lse(N), dlogits(N * Vp);
    CrossEntropyForwardCpu(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
    CrossEntropyBackwardCpu(dlogits.data(), logits.data(), lse.data(), targets.data(), 0.5f, N, V,
                            Vp);
    std::vector<float> params = start, m(start.size(), 0.0f), v(start.size(), 0.0f);
    AdamWUpdateCpu(params.data(), m.data(), v.data(), grads.data(), params.size(), hyper, 1);
    for (const auto* part : {&lse, &dlogits, &params, &m, &v}) Append(&losses, *part);
    return losses;
  });
}

}  // namespace
}  // namespace muster::kernels
