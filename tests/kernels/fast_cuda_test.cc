// The fused CUDA kernels (kernels/fast) against fp64 references or the CPU
// back end, on fresh random inputs, with outputs poisoned (NaN) before
// each run so an unwritten element fails, for every precision: fp32
// (exact), tf32 (tensor-core GEMMs) and bf16 (bf16 storage). Error is
// |out - ref| / |ref| over the whole tensor. Also: bitwise repeatability.
// The cuDNN attention path (cudnn_attention.h, tagged [cudnn]) against the
// same CPU reference as flash attention, and run to run bit for bit; it
// loads libcudnn.so.9 at run time, which scripts/gpu_run.sh finds and puts
// on the library path, and prints the cuDNN version and engines.
//
// Needs a GPU: tagged manual, run on the lent machine (docs/gpu.md).
//
// Built with MUSTER_SIMT as fast_simt_test, the same file runs its
// flash-attention, LayerNorm, classifier, encoder, AdamW and cast cases on
// the CPU emulation of kernels/simt (a CPU and the CUDA headers, no GPU;
// scripts/test.sh runs it), and the CUDA runtime calls below act on host
// memory. The GEMM, GEMM-attention, cuDNN and repeatability cases need
// cuBLASLt or cuDNN, which run on a GPU only, and are left out there.
// Built with MUSTER_SIMT_TSAN too, as fast_simt_race_test, the kernels run
// under the emulation's race checker (simt.h), and any race fails it; with
// MUSTER_SIMT_ASAN, as fast_simt_memcheck_test, under its memory checker,
// and any access out of bounds fails it.
#include <cuda_runtime.h>
#ifdef MUSTER_SIMT
#include "kernels/simt/simt.h"
#endif
#if defined(MUSTER_SIMT_TSAN) || defined(MUSTER_SIMT_ASAN)
#include <omp.h>
extern "C" void openblas_set_num_threads(int);
#endif

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/fast/adamw.h"
#include "kernels/fast/attention.h"
#include "kernels/fast/classifier.h"
#ifndef MUSTER_SIMT
#include "kernels/fast/cudnn_attention.h"
#endif
#include "kernels/fast/encoder.h"
#include "kernels/fast/flash_attention.h"
#include "kernels/fast/gemm.h"
#include "kernels/fast/layernorm.h"
#include "tests/kernels/flash_tilings.h"

namespace muster::kernels::fast {
namespace {

#if defined(MUSTER_SIMT_TSAN) || defined(MUSTER_SIMT_ASAN)
// Under the emulation's checkers the CPU references run on one thread:
// OpenMP's and OpenBLAS's threads wait for each other in ways
// ThreadSanitizer cannot see, so it would report the references' own
// writes (which thread takes which task varies from run to run), and the
// kernels are what is under test. Set before the first parallel region.
const bool kOneCpuThread = [] {
  omp_set_num_threads(1);
  openblas_set_num_threads(1);
  return true;
}();
#endif

#define CUDA_REQUIRE(call)                    \
  do {                                        \
    const int code_ = static_cast<int>(call); \
    INFO(#call << " returned " << code_);     \
    REQUIRE(code_ == 0);                      \
  } while (0)

unsigned Seed() {
  static std::random_device device;
  return device();
}

std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Host-side rounding (kernels/bf16.h), the reference for the device's
// __float2bfloat16_rn.
uint16_t Bf16Bits(float x) { return kernels::Bf16FromFloat(x); }
float FromBf16(uint16_t h) { return kernels::FloatFromBf16(h); }

// The precision under test: storage of activations and the GEMMs' math.
struct Mode {
  GemmMath math;
  const char* name;
  double tolerance;  // relative error bound of a kernel's output
};
const Mode kModes[] = {
    {GemmMath::kFp32, "fp32", 1e-5},
    {GemmMath::kTf32, "tf32", 2e-3},
    {GemmMath::kBf16, "bf16", 1e-2},
};
ActType ActOf(GemmMath math) { return math == GemmMath::kBf16 ? ActType::kBf16 : ActType::kF32; }

// A device buffer of act (or fp32) elements, uploaded from and read back
// as floats. Uploading to bf16 rounds the host values in place, so the
// reference sees exactly what the kernel reads.
class Buffer {
 public:
  Buffer(size_t n, ActType type) : n_(n), type_(type) {
#ifdef MUSTER_SIMT_ASAN
    // Exactly n elements, so the memory checker sees any access past them.
    REQUIRE(cudaMalloc(&ptr_, n * ActBytes(type)) == cudaSuccess);
#else
    REQUIRE(cudaMalloc(&ptr_, n * ActBytes(type) + 16) == cudaSuccess);
#endif
    Poison();
  }
  ~Buffer() { cudaFree(ptr_); }
  Buffer(const Buffer&) = delete;
  void* get() const { return ptr_; }
  float* f() const { return static_cast<float*>(ptr_); }
  void Poison() { REQUIRE(cudaMemset(ptr_, 0xff, n_ * ActBytes(type_)) == cudaSuccess); }
  void Upload(std::vector<float>* host) {
    REQUIRE(host->size() == n_);
    if (type_ == ActType::kF32) {
      REQUIRE(cudaMemcpy(ptr_, host->data(), n_ * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      return;
    }
    std::vector<uint16_t> bits(n_);
    for (size_t i = 0; i < n_; ++i) {
      bits[i] = Bf16Bits((*host)[i]);
      (*host)[i] = FromBf16(bits[i]);
    }
    REQUIRE(cudaMemcpy(ptr_, bits.data(), n_ * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<float> Download() const {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<float> host(n_);
    if (type_ == ActType::kF32) {
      REQUIRE(cudaMemcpy(host.data(), ptr_, n_ * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      return host;
    }
    std::vector<uint16_t> bits(n_);
    REQUIRE(cudaMemcpy(bits.data(), ptr_, n_ * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (size_t i = 0; i < n_; ++i) host[i] = FromBf16(bits[i]);
    return host;
  }
  std::vector<uint8_t> Bytes() const {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<uint8_t> bytes(n_ * ActBytes(type_));
    REQUIRE(cudaMemcpy(bytes.data(), ptr_, bytes.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return bytes;
  }

 private:
  size_t n_;
  ActType type_;
  void* ptr_ = nullptr;
};

// ||got - want|| / ||want||; every element must be finite.
double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << " of " << got.size());
    REQUIRE(std::isfinite(got[i]));
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

void RequireClose(const std::vector<float>& got, const std::vector<double>& want, double tolerance,
                  const std::string& what) {
  const double error = RelError(got, want);
  INFO(what << ": relative error " << error << ", bound " << tolerance);
  CHECK(error < tolerance);
}

std::vector<double> AsDoubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

double GeluRef(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double GeluGradRef(double x) {
  const double u = std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1 + th) +
         0.5 * x * (1 - th * th) * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * x * x);
}

TEST_CASE("bias gradient: deterministic column sums accumulate into dbias, match fp64", "[bias]") {
  // BiasGradient alone (the GEMM case below also runs it, through
  // cuBLASLt's Gemm): row chunks of 64 with a partial last one, and column
  // blocks of 32 packs with a partial last one.
  for (const Mode& mode : kModes) {
    for (const auto& [BT, OC] : {std::pair{300, 96}, std::pair{1000, 776}}) {
      SECTION(std::string(mode.name) + ", BT=" + std::to_string(BT) +
              ", OC=" + std::to_string(OC)) {
        std::mt19937 rng(Seed());
        const ActType act = ActOf(mode.math);
        auto dout = Random(size_t(BT) * OC, rng), dbias0 = Random(OC, rng);
        Buffer d_dout(dout.size(), act), d_dbias(OC, ActType::kF32);
        Buffer scratch(Gemm::BiasGradScratchFloats(BT, OC), ActType::kF32);
        d_dout.Upload(&dout);
        d_dbias.Upload(&dbias0);
        std::vector<double> dbias(OC);
        for (int o = 0; o < OC; ++o) {
          double sum = dbias0[o];
          for (int r = 0; r < BT; ++r) sum += dout[size_t(r) * OC + o];
          dbias[o] = sum;
        }
        CUDA_REQUIRE(BiasGradient(act, d_dbias.f(), GradWrite::kAdd, d_dout.get(), BT, OC,
                                  scratch.f(), nullptr));
        RequireClose(d_dbias.Download(), dbias, 1e-5, "dbias (accumulated, fp32 sums)");
      }
    }
  }
}

#ifndef MUSTER_SIMT  // cuBLASLt: a GPU only
std::unique_ptr<Gemm> MakeGemm(GemmMath math) {
  std::unique_ptr<Gemm> gemm;
  CUDA_REQUIRE(Gemm::Create(math, nullptr, &gemm));
  return gemm;
}

TEST_CASE("GEMM forward with bias and GELU epilogues matches fp64", "[gemm]") {
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      auto gemm = MakeGemm(mode.math);
      const int BT = 97, C = 64, OC = 192;
      auto inp = Random(BT * C, rng), weight = Random(OC * C, rng, 0.3f), bias = Random(OC, rng);
      Buffer d_inp(BT * C, act), d_weight(OC * C, act), d_bias(OC, act);
      d_inp.Upload(&inp);
      d_weight.Upload(&weight);
      d_bias.Upload(&bias);
      std::vector<double> pre(BT * OC), gelu(BT * OC);
      for (int r = 0; r < BT; ++r) {
        for (int o = 0; o < OC; ++o) {
          double sum = bias[o];
          for (int c = 0; c < C; ++c) sum += double(inp[r * C + c]) * weight[o * C + c];
          pre[r * OC + o] = sum;
          gelu[r * OC + o] = GeluRef(sum);
        }
      }
      Buffer out(BT * OC, act), pre_gelu(BT * OC, act);
      CUDA_REQUIRE(
          gemm->Forward(out.get(), nullptr, d_inp.get(), d_weight.get(), d_bias.get(), BT, C, OC));
      RequireClose(out.Download(), pre, mode.tolerance, "bias epilogue");
      out.Poison();
      CUDA_REQUIRE(gemm->Forward(out.get(), pre_gelu.get(), d_inp.get(), d_weight.get(),
                                 d_bias.get(), BT, C, OC));
      RequireClose(pre_gelu.Download(), pre, mode.tolerance, "GELU aux (pre-activation)");
      RequireClose(out.Download(), gelu, mode.tolerance, "GELU output");
    }
  }
}

TEST_CASE("GEMM backward: input (with GELU gradient), weight and bias match fp64", "[gemm]") {
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      auto gemm = MakeGemm(mode.math);
      const int BT = 300, C = 128, OC = 96;
      const float alpha = 0.75f;
      auto dout = Random(BT * OC, rng), weight = Random(OC * C, rng, 0.3f);
      auto inp = Random(BT * C, rng), pre = Random(BT * C, rng, 3.0f);
      auto dweight0 = Random(OC * C, rng), dbias0 = Random(OC, rng);
      Buffer d_dout(BT * OC, act), d_weight(OC * C, act), d_inp(BT * C, act), d_pre(BT * C, act);
      d_dout.Upload(&dout);
      d_weight.Upload(&weight);
      d_inp.Upload(&inp);
      d_pre.Upload(&pre);
      std::vector<double> dinp(BT * C), dinp_gelu(BT * C), dweight(OC * C), dbias(OC);
      for (int r = 0; r < BT; ++r) {
        for (int c = 0; c < C; ++c) {
          double sum = 0;
          for (int o = 0; o < OC; ++o) sum += double(dout[r * OC + o]) * weight[o * C + c];
          dinp[r * C + c] = alpha * sum;
          dinp_gelu[r * C + c] = sum * GeluGradRef(pre[r * C + c]);
        }
      }
      for (int o = 0; o < OC; ++o) {
        double bsum = dbias0[o];
        for (int r = 0; r < BT; ++r) bsum += dout[r * OC + o];
        dbias[o] = bsum;
        for (int c = 0; c < C; ++c) {
          double sum = 0;
          for (int r = 0; r < BT; ++r) sum += double(dout[r * OC + o]) * inp[r * C + c];
          dweight[o * C + c] = dweight0[o * C + c] + alpha * sum;
        }
      }
      Buffer d_dinp(BT * C, act);
      CUDA_REQUIRE(gemm->BackwardInput(d_dinp.get(), d_dout.get(), d_weight.get(), nullptr, BT, C,
                                       OC, alpha));
      RequireClose(d_dinp.Download(), dinp, mode.tolerance, "dinp");
      d_dinp.Poison();
      CUDA_REQUIRE(gemm->BackwardInput(d_dinp.get(), d_dout.get(), d_weight.get(), d_pre.get(), BT,
                                       C, OC, 1.0f));
      RequireClose(d_dinp.Download(), dinp_gelu, mode.tolerance, "dinp with GELU gradient");

      Buffer d_dweight(OC * C, ActType::kF32), d_dbias(OC, ActType::kF32);
      Buffer scratch(Gemm::BiasGradScratchFloats(BT, OC), ActType::kF32);
      d_dweight.Upload(&dweight0);
      d_dbias.Upload(&dbias0);
      CUDA_REQUIRE(gemm->BackwardWeight(d_dweight.f(), GradWrite::kAdd, d_dout.get(), d_inp.get(),
                                        BT, C, OC, alpha));
      CUDA_REQUIRE(
          gemm->BackwardBias(d_dbias.f(), GradWrite::kAdd, d_dout.get(), BT, OC, scratch.f()));
      RequireClose(d_dweight.Download(), dweight, mode.tolerance, "dweight (accumulated)");
      RequireClose(d_dbias.Download(), dbias, 1e-5, "dbias (accumulated, fp32 sums)");
    }
  }
}

TEST_CASE("attention forward and backward match the CPU back end", "[attention]") {
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      auto gemm = MakeGemm(mode.math);
      const int B = 2, T = 67, C = 128, NH = 4;
      auto qkv = Random(B * T * 3 * C, rng), dout = Random(B * T * C, rng);
      Buffer d_qkv(qkv.size(), act), d_dout(dout.size(), act);
      d_qkv.Upload(&qkv);
      d_dout.Upload(&dout);
      std::vector<float> out(B * T * C), att(B * NH * T * T), dqkv(qkv.size(), 0.0f),
          dpreatt(att.size());
      AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
      AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), B, T,
                           C, NH);
      Buffer d_out(out.size(), act), d_att(att.size(), act), scores(att.size(), ActType::kF32),
          d_dqkv(qkv.size(), act);
      CUDA_REQUIRE(
          AttentionForward(*gemm, d_out.get(), d_att.get(), scores.f(), d_qkv.get(), B, T, C, NH));
      RequireClose(d_out.Download(), AsDoubles(out), mode.tolerance, "out");
      const std::vector<float> got_att = d_att.Download();
      RequireClose(got_att, AsDoubles(att), mode.tolerance, "probabilities");
      for (int r = 0; r < B * NH * T; ++r) {
        for (int s = r % T + 1; s < T; ++s) REQUIRE(got_att[size_t(r) * T + s] == 0.0f);
      }
      CUDA_REQUIRE(AttentionBackward(*gemm, d_dqkv.get(), scores.f(), d_att.get(), d_dout.get(),
                                     d_qkv.get(), B, T, C, NH));
      RequireClose(d_dqkv.Download(), AsDoubles(dqkv), mode.tolerance, "dqkv");
    }
  }
}
#endif  // MUSTER_SIMT

// Causal attention's CPU reference on random inputs, rounded to bf16 if
// `act` is: qkv (B, T, 3C) and dout (B, T, C) uploaded to d_qkv / d_dout
// as `act`; out, the probabilities att (B, NH, T, T) and dqkv from the
// CPU back end. With `rise`, every query's score of key t grows by rise *
// t (each head's dim 0: 4 in the queries, rise * t / 4 in the keys), so a
// row's largest score keeps moving to later keys, and the flash forward's
// running max is raised in later steps, not only in the first.
struct AttentionCase {
  int B, T, C, NH;
  std::vector<float> qkv, dout, out, att, dqkv;
  Buffer d_qkv, d_dout;

  AttentionCase(int B_, int T_, int C_, int NH_, std::mt19937& rng, ActType act = ActType::kBf16,
                float rise = 0.0f)
      : B(B_),
        T(T_),
        C(C_),
        NH(NH_),
        qkv(Random(size_t(B_) * T_ * 3 * C_, rng, 2.0f)),
        dout(Random(size_t(B_) * T_ * C_, rng)),
        out(size_t(B_) * T_ * C_),
        att(size_t(B_) * NH_ * T_ * T_),
        dqkv(qkv.size(), 0.0f),
        d_qkv(qkv.size(), act),
        d_dout(dout.size(), act) {
    if (rise != 0.0f) {
      const int hs = C / NH;
      for (size_t row = 0; row < size_t(B) * T; ++row) {
        const float t = float(row % T);
        for (int h = 0; h < NH; ++h) {
          qkv[row * 3 * C + h * hs] = 4.0f;
          qkv[row * 3 * C + C + h * hs] = rise * t / 4.0f;
        }
      }
    }
    d_qkv.Upload(&qkv);
    d_dout.Upload(&dout);
    std::vector<float> dpreatt(att.size());
    AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
    AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                         NH);
  }

  // Each row's natural-log sum-exp of its scaled scores, from the CPU's
  // own probabilities: att[t][0] = exp(s_0 * scale - lse), so lse = s_0 *
  // scale - ln(att[t][0]), scale = 1 / sqrt(hs). (B, NH, T).
  std::vector<double> LogSumExp() const {
    const int hs = C / NH;
    std::vector<double> lse(size_t(B) * NH * T);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        for (int t = 0; t < T; ++t) {
          double s0 = 0;
          const float* q = &qkv[(size_t(b) * T + t) * 3 * C + h * hs];
          const float* k = &qkv[(size_t(b) * T + 0) * 3 * C + C + h * hs];
          for (int d = 0; d < hs; ++d) s0 += double(q[d]) * k[d];
          const double p0 = att[((size_t(b) * NH + h) * T + t) * T + 0];
          lse[(size_t(b) * NH + h) * T + t] = s0 / std::sqrt(double(hs)) - std::log(p0);
        }
      }
    }
    return lse;
  }

  // dqkv as a whole, then dq, dk and dv each on its own, so a wrong dK
  // cannot hide behind a right dV.
  void RequireGradientClose(const std::vector<float>& got, double tolerance) const {
    RequireClose(got, AsDoubles(dqkv), tolerance, "dqkv");
    for (int part = 0; part < 3; ++part) {
      std::vector<float> got_part;
      std::vector<double> want_part;
      for (size_t r = 0; r < size_t(B) * T; ++r) {
        for (int c = 0; c < C; ++c) {
          got_part.push_back(got[r * 3 * C + part * C + c]);
          want_part.push_back(dqkv[r * 3 * C + part * C + c]);
        }
      }
      RequireClose(got_part, want_part, tolerance, std::string("d") + "qkv"[part]);
    }
  }
};

// Flash attention with `math` and `tiling` against the CPU back end at
// B=2, C=256, NH=4 (head size 64) and the given T: out, each row's
// log2-sum-exp, then dqkv as a whole and each of dq, dk, dv. Bounds: bf16
// storage rounds every activation to 8 bits; TF32 keeps fp32 storage and
// rounds only the products' operands to 11 bits, which an emulation of
// the kernels' rounding on the CPU puts at relative errors of 3-4e-4
// (out) and 4-5e-4 (gradients) on these inputs.
void FlashCase(FlashMath math, const FlashTiling& tiling, int T, std::mt19937& rng,
               float rise = 0.0f) {
  const bool bf16 = math == FlashMath::kBf16;
  const ActType act = bf16 ? ActType::kBf16 : ActType::kF32;
  const double out_bound = bf16 ? 1e-2 : 2e-3, lse_bound = bf16 ? 1e-3 : 5e-4,
               grad_bound = bf16 ? 2e-2 : 2e-3;
  const int B = 2, C = 256, NH = 4;
  REQUIRE(FlashAttentionSupports(C, NH));
  const AttentionCase ref(B, T, C, NH, rng, act, rise);
  Buffer d_out(ref.out.size(), act), lse(size_t(B) * NH * T, ActType::kF32),
      scratch(FlashAttentionBackwardScratchFloats(math, B, T, NH, tiling), ActType::kF32),
      d_dqkv(ref.qkv.size(), act);
  CUDA_REQUIRE(FlashAttentionForward(math, d_out.get(), lse.f(), ref.d_qkv.get(), B, T, C, NH,
                                     nullptr, tiling));
  RequireClose(d_out.Download(), AsDoubles(ref.out), out_bound, "out");
  // Flash attention keeps the log2 form: lse / ln 2.
  std::vector<double> lse_ref = ref.LogSumExp();
  for (double& x : lse_ref) x /= std::log(2.0);
  RequireClose(lse.Download(), lse_ref, lse_bound, "log2-sum-exp");
  CUDA_REQUIRE(FlashAttentionBackward(math, d_dqkv.get(), scratch.f(), ref.d_dout.get(),
                                      d_out.get(), ref.d_qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                      tiling));
  ref.RequireGradientClose(d_dqkv.Download(), grad_bound);
}

// FlashCase for each named tiling at T = 64 (one tile of 64, half a block
// of 128), 200 (ending in a partial tile) and 520 (five blocks of 128, the
// last with 8 rows, and ten key tiles, the last with 8 keys), a section
// each, and at T = 200 with scores rising along the keys (AttentionCase's
// `rise`: 1 a key, 11.5 in the exponent's log2 units over a step of 64,
// past the forward's threshold for raising its running max). Under the
// race checker (MUSTER_SIMT_TSAN, six times slower) 64 and 200 only, 200
// already reusing each double buffer, and no rising scores.
void FlashCases(FlashMath math) {
#ifdef MUSTER_SIMT_TSAN
  const std::vector<int> lengths = {64, 200};
#else
  const std::vector<int> lengths = {64, 200, 520};
#endif
  for (const auto& [tiling_name, tiling] : CompiledFlashTilings(math)) {
    for (const int T : lengths) {
      SECTION(tiling_name + ", T=" + std::to_string(T)) {
        std::mt19937 rng(Seed());
        FlashCase(math, tiling, T, rng);
      }
    }
#ifndef MUSTER_SIMT_TSAN  // the raise touches no memory: nothing to race
    SECTION(tiling_name + ", T=200, rising scores") {
      std::mt19937 rng(Seed());
      FlashCase(math, tiling, 200, rng, 1.0f);
    }
#endif
  }
}

TEST_CASE("flash attention forward and backward match the CPU back end", "[attention]") {
  // Every compiled bf16 tiling of each kernel (flash_tilings.h).
  FlashCases(FlashMath::kBf16);
}

TEST_CASE("tf32 flash attention matches the CPU back end", "[attention][tf32]") {
  // fp32 activations, TF32 operands: every compiled tf32 tiling.
  FlashCases(FlashMath::kTf32);
}

TEST_CASE("flash attention refuses a tiling it has not compiled", "[attention]") {
  const int B = 1, T = 64, C = 128, NH = 2;
  Buffer qkv(size_t(B) * T * 3 * C, ActType::kBf16), out(size_t(B) * T * C, ActType::kBf16),
      lse(size_t(B) * NH * T, ActType::kF32), delta(size_t(B) * NH * T, ActType::kF32),
      dqkv(size_t(B) * T * 3 * C, ActType::kBf16);
  FlashTiling bad;
  bad.forward = {64, 64, false, 0};
  REQUIRE(FlashAttentionForward(FlashMath::kBf16, out.get(), lse.f(), qkv.get(), B, T, C, NH,
                                nullptr, bad) == cudaErrorInvalidValue);
  bad = FlashTiling{};
  bad.query = {16, 8, false, 0};
  REQUIRE(FlashAttentionBackward(FlashMath::kBf16, dqkv.get(), delta.f(), out.get(), out.get(),
                                 qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                 bad) == cudaErrorInvalidValue);
  // bf16's defaults (32 rows a warp, dK/dV values in registers) are not
  // compiled for tf32.
  REQUIRE(FlashAttentionForward(FlashMath::kTf32, out.get(), lse.f(), qkv.get(), B, T, C, NH,
                                nullptr, FlashTiling{}) == cudaErrorInvalidValue);
  REQUIRE(FlashAttentionBackward(FlashMath::kTf32, dqkv.get(), delta.f(), out.get(), out.get(),
                                 qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                 FlashTiling{}) == cudaErrorInvalidValue);
  // A stored dS: bf16 only, its dQ stepping through whole tiles, and
  // its own dK/dV tilings.
  FlashTiling stored;
  stored.stored_ds = true;
  stored.query = {16, 32, false, 0};
  REQUIRE(FlashAttentionBackward(FlashMath::kBf16, dqkv.get(), delta.f(), out.get(), out.get(),
                                 qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                 stored) == cudaErrorInvalidValue);
  stored.query = {16, 64, false, 0};
  stored.key_value = {16, 64, true, 0};
  REQUIRE(FlashAttentionBackward(FlashMath::kBf16, dqkv.get(), delta.f(), out.get(), out.get(),
                                 qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                 stored) == cudaErrorInvalidValue);
  REQUIRE(FlashAttentionBackwardScratchFloats(FlashMath::kBf16, B, T, NH, stored) == 0);
  stored = FlashDefaultTiling(FlashMath::kTf32);
  stored.stored_ds = true;
  stored.query = {16, 64, false, 0};
  REQUIRE(FlashAttentionBackward(FlashMath::kTf32, dqkv.get(), delta.f(), out.get(), out.get(),
                                 qkv.get(), lse.f(), B, T, C, NH, nullptr,
                                 stored) == cudaErrorInvalidValue);
}

#ifndef MUSTER_SIMT  // cuDNN: a GPU only
// A CudnnAttention call that must return 0; the failure message carries
// what cuDNN said (error()), or the CUDA error's name.
#define CUDNN_REQUIRE(attention, call)                                                            \
  do {                                                                                            \
    const int code_ = static_cast<int>(call);                                                     \
    INFO(#call << " returned " << code_ << ": "                                                   \
               << (code_ == kCudnnError                                                           \
                       ? "kCudnnError: " + (attention).error()                                    \
                       : std::string(cudaGetErrorString(static_cast<cudaError_t>(code_))) + " " + \
                             (attention).error()));                                               \
    REQUIRE(code_ == 0);                                                                          \
  } while (0)

// The GPU log's record of which cuDNN ran: its version (once per process)
// and the engines `attention` picked.
void PrintCudnn(const CudnnAttention& attention, const std::string& what) {
  static bool version_printed = false;
  if (!version_printed) {
    std::printf("cudnn attention: cuDNN version %ld\n", attention.version());
    version_printed = true;
  }
  std::printf("cudnn attention, %s: workspace %zu bytes\n%s\n", what.c_str(),
              attention.workspace_bytes(), attention.Describe().c_str());
  std::fflush(stdout);
}

TEST_CASE("cudnn attention forward and backward match the CPU back end", "[attention][cudnn]") {
  // The flash test's shapes (T = 64, 200 with a partial tile, 520) at head
  // size 64, and again at head size 128, which only cuDNN runs.
  for (const int NH : {4, 2}) {
    for (const int T : {64, 200, 520}) {
      const int B = 2, C = 256, hs = C / NH;
      SECTION("hs=" + std::to_string(hs) + ", T=" + std::to_string(T)) {
        const ActType act = ActType::kBf16;
        if (hs == 64) REQUIRE(CudnnAttentionSupports(act, C, NH));
        if (!CudnnAttentionSupports(act, C, NH)) {
          WARN("CudnnAttentionSupports says no to head size " << hs << ": not checked");
          return;
        }
        std::mt19937 rng(Seed());
        const AttentionCase ref(B, T, C, NH, rng);
        Buffer d_out(ref.out.size(), act), stats(size_t(B) * NH * T, ActType::kF32),
            softmax_sum(size_t(B) * NH * T, ActType::kF32), d_dqkv(ref.qkv.size(), act);
        CudnnAttention attention;
        CUDNN_REQUIRE(attention, attention.Forward(d_out.get(), stats.f(), ref.d_qkv.get(), B, T, C,
                                                   NH, nullptr));
        RequireClose(d_out.Download(), AsDoubles(ref.out), 1e-2, "out");
        RequireClose(stats.Download(), ref.LogSumExp(), 1e-3, "stats (natural-log sum-exp)");
        CUDNN_REQUIRE(attention, attention.Backward(d_dqkv.get(), softmax_sum.f(), ref.d_dout.get(),
                                                    d_out.get(), ref.d_qkv.get(), stats.f(), B, T,
                                                    C, NH, nullptr));
        ref.RequireGradientClose(d_dqkv.Download(), 2e-2);
        PrintCudnn(attention, "hs=" + std::to_string(hs) + " T=" + std::to_string(T));
      }
    }
  }
}

TEST_CASE("cudnn attention is bitwise repeatable", "[attention][cudnn]") {
  // GPT-2 124M's heads at T=512: forward and backward twice with one
  // CudnnAttention (its plans kept, as in training), then once with a
  // fresh one (plans built again, as after a restart), each into fresh
  // poisoned outputs.
  const ActType act = ActType::kBf16;
  const int B = 4, T = 512, C = 768, NH = 12;
  REQUIRE(CudnnAttentionSupports(act, C, NH));
  std::mt19937 rng(Seed());
  auto qkv = Random(size_t(B) * T * 3 * C, rng, 2.0f), dout = Random(size_t(B) * T * C, rng);
  Buffer d_qkv(qkv.size(), act), d_dout(dout.size(), act);
  d_qkv.Upload(&qkv);
  d_dout.Upload(&dout);
  const char* const names[] = {"out", "stats", "dqkv"};
  auto run = [&](CudnnAttention& attention) {
    Buffer out(size_t(B) * T * C, act), stats(size_t(B) * NH * T, ActType::kF32),
        softmax_sum(size_t(B) * NH * T, ActType::kF32), dqkv(qkv.size(), act);
    CUDNN_REQUIRE(attention,
                  attention.Forward(out.get(), stats.f(), d_qkv.get(), B, T, C, NH, nullptr));
    CUDNN_REQUIRE(attention,
                  attention.Backward(dqkv.get(), softmax_sum.f(), d_dout.get(), out.get(),
                                     d_qkv.get(), stats.f(), B, T, C, NH, nullptr));
    // Written everywhere: a poisoned (NaN) element left would repeat too.
    const Buffer* const buffers[] = {&out, &stats, &dqkv};
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> values = buffers[i]->Download();
      size_t bad = 0;
      for (const float x : values) bad += !std::isfinite(x);
      INFO(names[i] << ": " << bad << " of " << values.size() << " not finite");
      CHECK(bad == 0);
    }
    return std::vector<std::vector<uint8_t>>{out.Bytes(), stats.Bytes(), dqkv.Bytes()};
  };
  CudnnAttention attention;
  const auto first = run(attention);
  const auto second = run(attention);
  CudnnAttention fresh;
  const auto third = run(fresh);
  PrintCudnn(attention, "B=4 T=512 C=768 NH=12");
  const std::vector<std::vector<uint8_t>>* const others[] = {&second, &third};
  const char* const labels[] = {"the second run", "a fresh CudnnAttention"};
  for (int o = 0; o < 2; ++o) {
    for (size_t i = 0; i < first.size(); ++i) {
      const std::vector<uint8_t>& a = first[i];
      const std::vector<uint8_t>& b = (*others[o])[i];
      REQUIRE(a.size() == b.size());
      size_t differ = 0;
      for (size_t j = 0; j < a.size(); ++j) differ += a[j] != b[j];
      INFO(names[i] << ", " << labels[o] << " against the first: " << differ << " of " << a.size()
                    << " bytes differ");
      CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
    }
  }
}
#endif  // MUSTER_SIMT

TEST_CASE("layernorm with the fused residual add, forward and backward, match fp64",
          "[layernorm]") {
  // Lanes with fewer packs of a row than others (C = 192); the backward's
  // per-warp sums in more than the 48 KB of shared memory a launch gets
  // unasked (C = 1024 and 1152: 64 and 72 KB); more blocks of partial sums
  // (N = 300: 10) than AddColumnSums has slices (8). Rows held in registers
  // (at most 4 packs a lane: C = 192 and 320 in both types, 640, 768 and
  // 1024 in bf16; C = 192 with some lanes' last pack past the row), the
  // backward's parameter sums in registers (up to 3 packs: 192, 320, 640
  // and 768 in bf16, 192 and 320 in fp32; a third pack that only some
  // lanes have: 640 in bf16, 320 in fp32) or in shared memory (1024 in
  // bf16), and rows read again in each pass (C = 1152; 640, 768 and 1024
  // in fp32).
  for (const Mode& mode : kModes) {
    for (const auto& [N, C] : {std::pair{203, 192}, std::pair{70, 1024}, std::pair{300, 1152},
                               std::pair{45, 768}, std::pair{50, 320}, std::pair{61, 640}}) {
      SECTION(std::string(mode.name) + ", N=" + std::to_string(N) + ", C=" + std::to_string(C)) {
        std::mt19937 rng(Seed());
        const ActType act = ActOf(mode.math);
        auto a = Random(N * C, rng, 2.0f), b = Random(N * C, rng), weight = Random(C, rng),
             bias = Random(C, rng), dout = Random(N * C, rng), dinp0 = Random(N * C, rng),
             dweight0 = Random(C, rng), dbias0 = Random(C, rng);
        Buffer d_a(N * C, act), d_b(N * C, act), d_w(C, ActType::kF32), d_bias(C, ActType::kF32);
        // Uploads round bf16 inputs in place: the references below use the
        // rounded values.
        Buffer d_dout(N * C, act), d_dinp(N * C, act), d_dw(C, ActType::kF32),
            d_db(C, ActType::kF32), scratch(LayerNormBackwardScratchFloats(N, C), ActType::kF32);
        d_dout.Upload(&dout);
        d_dinp.Upload(&dinp0);
        d_a.Upload(&a);
        d_b.Upload(&b);
        d_w.Upload(&weight);
        d_bias.Upload(&bias);
        Buffer residual(N * C, act), out(N * C, act), mean(N, ActType::kF32),
            rstd(N, ActType::kF32);
        CUDA_REQUIRE(LayerNormForward(act, out.get(), mean.f(), rstd.f(), residual.get(), d_a.get(),
                                      d_b.get(), d_w.f(), d_bias.f(), N, C, nullptr));
        std::vector<float> x = residual.Download();  // as stored: the LN's input
        std::vector<double> x_ref(N * C), out_ref(N * C), mean_ref(N), rstd_ref(N);
        for (size_t i = 0; i < x.size(); ++i) x_ref[i] = double(a[i]) + b[i];
        RequireClose(x, x_ref, mode.tolerance, "residual");
        std::vector<double> dinp_ref(dinp0.begin(), dinp0.end()),
            dw_ref(dweight0.begin(), dweight0.end()), db_ref(dbias0.begin(), dbias0.end());
        for (int r = 0; r < N; ++r) {
          const float* row = &x[size_t(r) * C];
          double m = 0, v = 0;
          for (int c = 0; c < C; ++c) m += row[c];
          m /= C;
          for (int c = 0; c < C; ++c) v += (row[c] - m) * (row[c] - m);
          const double rs = 1 / std::sqrt(v / C + 1e-5);
          mean_ref[r] = m;
          rstd_ref[r] = rs;
          double dnorm_mean = 0, dnorm_xhat_mean = 0;
          for (int c = 0; c < C; ++c) {
            const double xhat = (row[c] - m) * rs, g = dout[size_t(r) * C + c];
            out_ref[size_t(r) * C + c] = xhat * weight[c] + bias[c];
            dnorm_mean += g * weight[c] / C;
            dnorm_xhat_mean += g * weight[c] * xhat / C;
            dw_ref[c] += g * xhat;
            db_ref[c] += g;
          }
          for (int c = 0; c < C; ++c) {
            const double xhat = (row[c] - m) * rs, g = dout[size_t(r) * C + c];
            dinp_ref[size_t(r) * C + c] +=
                (g * weight[c] - dnorm_mean - xhat * dnorm_xhat_mean) * rs;
          }
        }
        RequireClose(out.Download(), out_ref, mode.tolerance, "out");
        RequireClose(mean.Download(), mean_ref, 1e-5, "mean");
        RequireClose(rstd.Download(), rstd_ref, 1e-5, "rstd");

        // Without the residual: LayerNorm of inp1 alone.
        out.Poison();
        Buffer d_x(N * C, act);
        d_x.Upload(&x);
        CUDA_REQUIRE(LayerNormForward(act, out.get(), mean.f(), rstd.f(), nullptr, d_x.get(),
                                      nullptr, d_w.f(), d_bias.f(), N, C, nullptr));
        RequireClose(out.Download(), out_ref, mode.tolerance, "out without residual");

        d_dw.Upload(&dweight0);
        d_db.Upload(&dbias0);
        CUDA_REQUIRE(LayerNormBackward(act, d_dinp.get(), d_dw.f(), d_db.f(), GradWrite::kAdd,
                                       d_dout.get(), d_x.get(), d_w.f(), mean.f(), rstd.f(), N, C,
                                       scratch.f(), nullptr));
        RequireClose(d_dinp.Download(), dinp_ref, mode.tolerance, "dinp (accumulated)");
        RequireClose(d_dw.Download(), dw_ref, mode.tolerance, "dweight (accumulated)");
        RequireClose(d_db.Download(), db_ref, mode.tolerance, "dbias (accumulated)");
      }
    }
  }
}

TEST_CASE("column sums deferred to one launch give each sum's bits of its own launch",
          "[bias][layernorm]") {
  // Bias and LayerNorm gradients whose second passes join a
  // ColumnSumsBatch, against the same calls each finishing alone: equal
  // bit for bit. Nine jobs where a batch holds eight, so Add also runs a
  // full batch; widths not a multiple of the 32 columns of a block, so a
  // job's last block is partial and the next job's first block follows it.
  struct Job {
    bool layernorm;
    int N, C;
  };
  const Job jobs[] = {{false, 300, 96}, {true, 203, 192},  {false, 1000, 776},
                      {false, 70, 40},  {true, 300, 1152}, {false, 8, 2304},
                      {true, 33, 64},   {false, 129, 72},  {true, 70, 1024}};
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      // Per job: [0] the sums alone, [1] deferred.
      struct Run {
        std::unique_ptr<Buffer> out1[2], out2[2], dinp[2], scratch[2];
        std::unique_ptr<Buffer> dout, inp, weight, mean, rstd;
      };
      std::vector<Run> runs(std::size(jobs));
      ColumnSumsBatch batch;
      for (size_t j = 0; j < std::size(jobs); ++j) {
        const Job& job = jobs[j];
        Run& run = runs[j];
        const size_t NC = size_t(job.N) * job.C;
        auto dout = Random(NC, rng);
        run.dout = std::make_unique<Buffer>(NC, act);
        run.dout->Upload(&dout);
        auto out1 = Random(job.C, rng), out2 = Random(job.C, rng), dinp = Random(NC, rng);
        if (job.layernorm) {
          auto inp = Random(NC, rng), weight = Random(job.C, rng), mean = Random(job.N, rng),
               rstd = Random(job.N, rng);
          for (float& r : rstd) r = 1.0f + std::fabs(r);
          run.inp = std::make_unique<Buffer>(NC, act);
          run.weight = std::make_unique<Buffer>(job.C, ActType::kF32);
          run.mean = std::make_unique<Buffer>(job.N, ActType::kF32);
          run.rstd = std::make_unique<Buffer>(job.N, ActType::kF32);
          run.inp->Upload(&inp);
          run.weight->Upload(&weight);
          run.mean->Upload(&mean);
          run.rstd->Upload(&rstd);
        }
        for (int k = 0; k < 2; ++k) {
          ColumnSumsBatch* defer = k == 1 ? &batch : nullptr;
          run.out1[k] = std::make_unique<Buffer>(job.C, ActType::kF32);
          run.out1[k]->Upload(&out1);
          if (!job.layernorm) {
            run.scratch[k] =
                std::make_unique<Buffer>(Gemm::BiasGradScratchFloats(job.N, job.C), ActType::kF32);
            CUDA_REQUIRE(BiasGradient(act, run.out1[k]->f(), GradWrite::kAdd, run.dout->get(),
                                      job.N, job.C, run.scratch[k]->f(), nullptr, defer));
            continue;
          }
          run.out2[k] = std::make_unique<Buffer>(job.C, ActType::kF32);
          run.out2[k]->Upload(&out2);
          run.dinp[k] = std::make_unique<Buffer>(NC, act);
          run.dinp[k]->Upload(&dinp);
          run.scratch[k] =
              std::make_unique<Buffer>(LayerNormBackwardScratchFloats(job.N, job.C), ActType::kF32);
          CUDA_REQUIRE(LayerNormBackward(
              act, run.dinp[k]->get(), run.out1[k]->f(), run.out2[k]->f(), GradWrite::kAdd,
              run.dout->get(), run.inp->get(), run.weight->f(), run.mean->f(), run.rstd->f(), job.N,
              job.C, run.scratch[k]->f(), nullptr, defer));
        }
      }
      REQUIRE(batch.size() == 1);  // the ninth; the first eight ran when it was added
      CUDA_REQUIRE(batch.Flush(nullptr));
      REQUIRE(batch.size() == 0);
      for (size_t j = 0; j < std::size(jobs); ++j) {
        INFO("job " << j << ": " << (jobs[j].layernorm ? "layernorm" : "bias") << " N=" << jobs[j].N
                    << " C=" << jobs[j].C);
        const Run& run = runs[j];
        REQUIRE(run.out1[1]->Bytes() == run.out1[0]->Bytes());
        if (!jobs[j].layernorm) continue;
        REQUIRE(run.out2[1]->Bytes() == run.out2[0]->Bytes());
        REQUIRE(run.dinp[1]->Bytes() == run.dinp[0]->Bytes());
      }
    }
  }
}

// A batch's tokens on the device: grouped as EncoderBackward reads them
// (GroupByToken's arrays), then the tokens as EncoderForward reads them.
class DeviceTokens {
 public:
  explicit DeviceTokens(const std::vector<int>& tokens) {
    const EncoderGroups groups = GroupByToken(tokens.data(), static_cast<int>(tokens.size()));
    groups_ = groups.groups();
    std::vector<int> packed = groups.tokens;
    packed.insert(packed.end(), groups.starts.begin(), groups.starts.end());
    packed.insert(packed.end(), groups.positions.begin(), groups.positions.end());
    packed.insert(packed.end(), tokens.begin(), tokens.end());
    REQUIRE(cudaMalloc(&ints_, packed.size() * sizeof(int)) == cudaSuccess);
    REQUIRE(cudaMemcpy(ints_, packed.data(), packed.size() * sizeof(int), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    tokens_ = ints_ + 2 * groups_ + 1 + tokens.size();
  }
  ~DeviceTokens() { cudaFree(ints_); }
  DeviceTokens(const DeviceTokens&) = delete;
  int groups() const { return groups_; }
  const int* group_tokens() const { return ints_; }
  const int* group_starts() const { return ints_ + groups_; }
  const int* positions() const { return ints_ + 2 * groups_ + 1; }
  const int* tokens() const { return tokens_; }

 private:
  int* ints_ = nullptr;
  int groups_ = 0;
  const int* tokens_ = nullptr;
};

TEST_CASE("a gradient written over gives the bits of one added into zeros",
          "[bias][layernorm][encoder][gemm]") {
  // The model's first Backward since ZeroGrad writes its gradients over
  // stale values (GradWrite::kOverwrite): here over poison (NaN), against
  // the same sums added into zeros (kAdd). Equal bit for bit, each sum
  // alone and in one ColumnSumsBatch that mixes both ways; a kernel that
  // read what it writes over would give NaN.
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      const int N = 300, C = 192, OC = 3 * C;
      auto dout = Random(size_t(N) * OC, rng), ln_dout = Random(size_t(N) * C, rng),
           inp = Random(size_t(N) * C, rng), weight = Random(C, rng), mean = Random(N, rng),
           rstd = Random(N, rng), dinp0 = Random(size_t(N) * C, rng);
      for (float& r : rstd) r = 1.0f + std::fabs(r);
      Buffer d_dout(dout.size(), act), d_ln_dout(ln_dout.size(), act), d_inp(inp.size(), act),
          d_weight(C, ActType::kF32), d_mean(N, ActType::kF32), d_rstd(N, ActType::kF32);
      d_dout.Upload(&dout);
      d_ln_dout.Upload(&ln_dout);
      d_inp.Upload(&inp);
      d_weight.Upload(&weight);
      d_mean.Upload(&mean);
      d_rstd.Upload(&rstd);
      // [deferred][write]: the bias gradient, LayerNorm's dweight, dbias
      // and dinp, and each call's scratch.
      std::unique_ptr<Buffer> bias[2][2], dw[2][2], db[2][2], dinp[2][2], scratch[2][2][2];
      ColumnSumsBatch batch;
      for (int deferred = 0; deferred < 2; ++deferred) {
        for (const GradWrite write : {GradWrite::kAdd, GradWrite::kOverwrite}) {
          const int w = write == GradWrite::kOverwrite;
          ColumnSumsBatch* defer = deferred ? &batch : nullptr;
          bias[deferred][w] = std::make_unique<Buffer>(OC, ActType::kF32);
          dw[deferred][w] = std::make_unique<Buffer>(C, ActType::kF32);
          db[deferred][w] = std::make_unique<Buffer>(C, ActType::kF32);
          if (write == GradWrite::kAdd) {  // else left poisoned
            std::vector<float> zeros(OC, 0.0f), zeros_c(C, 0.0f), zeros_c2(C, 0.0f);
            bias[deferred][w]->Upload(&zeros);
            dw[deferred][w]->Upload(&zeros_c);
            db[deferred][w]->Upload(&zeros_c2);
          }
          dinp[deferred][w] = std::make_unique<Buffer>(dinp0.size(), act);
          dinp[deferred][w]->Upload(&dinp0);
          scratch[deferred][w][0] =
              std::make_unique<Buffer>(Gemm::BiasGradScratchFloats(N, OC), ActType::kF32);
          scratch[deferred][w][1] =
              std::make_unique<Buffer>(LayerNormBackwardScratchFloats(N, C), ActType::kF32);
          CUDA_REQUIRE(BiasGradient(act, bias[deferred][w]->f(), write, d_dout.get(), N, OC,
                                    scratch[deferred][w][0]->f(), nullptr, defer));
          CUDA_REQUIRE(LayerNormBackward(act, dinp[deferred][w]->get(), dw[deferred][w]->f(),
                                         db[deferred][w]->f(), write, d_ln_dout.get(), d_inp.get(),
                                         d_weight.f(), d_mean.f(), d_rstd.f(), N, C,
                                         scratch[deferred][w][1]->f(), nullptr, defer));
        }
      }
      REQUIRE(batch.size() == 4);
      CUDA_REQUIRE(batch.Flush(nullptr));
      const std::vector<uint8_t> want_bias = bias[0][0]->Bytes(), want_dw = dw[0][0]->Bytes(),
                                 want_db = db[0][0]->Bytes(), want_dinp = dinp[0][0]->Bytes();
      for (const auto& [deferred, w] : {std::pair{0, 1}, std::pair{1, 0}, std::pair{1, 1}}) {
        INFO((deferred ? "deferred, " : "alone, ") << (w ? "written over" : "added"));
        REQUIRE(bias[deferred][w]->Bytes() == want_bias);
        REQUIRE(dw[deferred][w]->Bytes() == want_dw);
        REQUIRE(db[deferred][w]->Bytes() == want_db);
        REQUIRE(dinp[deferred][w]->Bytes() == want_dinp);
      }

      // The position embedding's gradient: rows [0, T) written over, the
      // rest of its maxT rows left as they were (still poison).
      const int B = 3, T = 40, maxT = 48, E = 64, Vp = 128;
      std::vector<int> tokens(B * T);
      for (int& t : tokens) t = std::uniform_int_distribution<int>(0, 19)(rng);
      auto enc_dout = Random(size_t(B) * T * E, rng), dwte0 = Random(size_t(Vp) * E, rng);
      Buffer d_enc_dout(enc_dout.size(), act);
      d_enc_dout.Upload(&enc_dout);
      const DeviceTokens d_tokens(tokens);
      std::vector<uint8_t> dwte_bytes[2], dwpe_bytes[2];
      for (const GradWrite write : {GradWrite::kAdd, GradWrite::kOverwrite}) {
        const int w = write == GradWrite::kOverwrite;
        Buffer d_dwte(dwte0.size(), ActType::kF32), d_dwpe(size_t(maxT) * E, ActType::kF32);
        d_dwte.Upload(&dwte0);  // always added into
        if (write == GradWrite::kAdd) {
          std::vector<float> zeros(size_t(maxT) * E, 0.0f);
          d_dwpe.Upload(&zeros);
        }
        CUDA_REQUIRE(EncoderBackward(act, d_dwte.f(), d_dwpe.f(), write, d_enc_dout.get(),
                                     d_tokens.group_tokens(), d_tokens.group_starts(),
                                     d_tokens.positions(), d_tokens.groups(), B, T, E, nullptr));
        dwte_bytes[w] = d_dwte.Bytes();
        dwpe_bytes[w] = d_dwpe.Bytes();
      }
      REQUIRE(dwte_bytes[1] == dwte_bytes[0]);
      const size_t written = size_t(T) * E * sizeof(float);
      REQUIRE(std::equal(dwpe_bytes[1].begin(), dwpe_bytes[1].begin() + written,
                         dwpe_bytes[0].begin()));
      REQUIRE(std::all_of(dwpe_bytes[1].begin() + written, dwpe_bytes[1].end(),
                          [](uint8_t byte) { return byte == 0xff; }));

#ifndef MUSTER_SIMT  // cuBLASLt: a GPU only
      // A weight gradient by cuBLASLt: beta 0 against beta 1 over zeros.
      auto gemm = MakeGemm(mode.math);
      const int K = 96;
      auto x = Random(size_t(N) * K, rng), dy = Random(size_t(N) * C, rng);
      Buffer d_x(x.size(), act), d_dy(dy.size(), act);
      d_x.Upload(&x);
      d_dy.Upload(&dy);
      std::vector<uint8_t> dweight_bytes[2];
      for (const GradWrite write : {GradWrite::kAdd, GradWrite::kOverwrite}) {
        Buffer d_dweight(size_t(C) * K, ActType::kF32);
        if (write == GradWrite::kAdd) {
          std::vector<float> zeros(size_t(C) * K, 0.0f);
          d_dweight.Upload(&zeros);
        }
        CUDA_REQUIRE(
            gemm->BackwardWeight(d_dweight.f(), write, d_dy.get(), d_x.get(), N, K, C, 0.75f));
        dweight_bytes[write == GradWrite::kOverwrite] = d_dweight.Bytes();
      }
      REQUIRE(dweight_bytes[1] == dweight_bytes[0]);
#endif
    }
  }
}

TEST_CASE("fused classifier: loss and logit gradient match fp64", "[classifier]") {
  // Widths for all three kernels (classifier.cu) in each type. Each shape
  // names the kernel it must run in fp32 and in bf16 where an SM has an
  // H100's 228 KB of shared memory (the emulation's too); on another GPU
  // the choice is only reported. (On an H100 the staged kernel went
  // unused, its results right, until memcheck showed its attribute
  // refused.)
  using P = ClassifierPath;
  struct Shape {
    int BT, V, Vp;
    ClassifierPath f32, bf16;
  };
  const bool h100_shared = [] {
#ifdef MUSTER_SIMT
    return true;
#else
    int device = 0, per_sm = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) ==
               cudaSuccess &&
           per_sm == 228 * 1024;
#endif
  }();
  for (const Shape shape : {Shape{37, 1000, 1024, P::kTwoReads, P::kTwoReads},
                            Shape{7, 5000, 5056, P::kStaged, P::kStaged},
                            Shape{3, 29999, 30016, P::kRegisters, P::kStaged},
                            Shape{5, 50257, 50304, P::kTwoReads, P::kStaged},
                            Shape{3, 60000, 60032, P::kTwoReads, P::kRegisters},
                            Shape{3, 70001, 70016, P::kTwoReads, P::kTwoReads}}) {
    const int BT = shape.BT, V = shape.V, Vp = shape.Vp;
    for (const Mode& mode : kModes) {
      SECTION(std::string(mode.name) + ", V=" + std::to_string(V)) {
        std::mt19937 rng(Seed());
        const ActType act = ActOf(mode.math);
        const ClassifierPath path = ClassifierPathFor(act, Vp);
        INFO("kernel " << static_cast<int>(path) << " (0 two reads, 1 staged, 2 registers)");
        if (h100_shared) {
          REQUIRE(path == (act == ActType::kBf16 ? shape.bf16 : shape.f32));
        }
        const float dloss = 1.0f / BT;
        auto logits = Random(size_t(BT) * Vp, rng, 4.0f);
        // Each row's largest logit is its last (V - 1), in the pack that
        // crosses V where V is not a multiple of a pack: that pack's bound
        // must not drop it.
        for (int r = 0; r < BT; ++r) logits[size_t(r) * Vp + V - 1] = 6.0f;
        std::vector<int> targets(BT);
        for (int& t : targets) t = std::uniform_int_distribution<int>(0, V - 1)(rng);
        Buffer d_logits(logits.size(), act), losses(BT, ActType::kF32);
        d_logits.Upload(&logits);
        int* d_targets = nullptr;
        REQUIRE(cudaMalloc(&d_targets, BT * sizeof(int)) == cudaSuccess);
        REQUIRE(cudaMemcpy(d_targets, targets.data(), BT * sizeof(int), cudaMemcpyHostToDevice) ==
                cudaSuccess);
        std::vector<double> loss_ref(BT), grad_ref(logits.size());
        for (int r = 0; r < BT; ++r) {
          const float* row = &logits[size_t(r) * Vp];
          double max = row[0], sum = 0;
          for (int v = 0; v < V; ++v) max = std::max(max, double(row[v]));
          for (int v = 0; v < V; ++v) sum += std::exp(row[v] - max);
          const double lse = max + std::log(sum);
          loss_ref[r] = lse - row[targets[r]];
          for (int v = 0; v < Vp; ++v) {
            grad_ref[size_t(r) * Vp + v] =
                v < V ? (std::exp(row[v] - lse) - (v == targets[r])) * dloss : 0.0;
          }
        }
        // Loss only: the logits stay as they are.
        const std::vector<uint8_t> before = d_logits.Bytes();
        CUDA_REQUIRE(ClassifierForward(act, losses.f(), d_logits.get(), d_targets, dloss, false, BT,
                                       V, Vp, nullptr));
        RequireClose(losses.Download(), loss_ref, 1e-5, "losses");
        REQUIRE(d_logits.Bytes() == before);
        losses.Poison();
        CUDA_REQUIRE(ClassifierForward(act, losses.f(), d_logits.get(), d_targets, dloss, true, BT,
                                       V, Vp, nullptr));
        RequireClose(losses.Download(), loss_ref, 1e-5, "losses (with gradient)");
        RequireClose(d_logits.Download(), grad_ref, mode.tolerance, "dlogits");
        cudaFree(d_targets);
      }
    }
  }
}

TEST_CASE("encoder forward and token-grouped backward match fp64", "[encoder]") {
  for (const Mode& mode : kModes) {
    SECTION(mode.name) {
      std::mt19937 rng(Seed());
      const ActType act = ActOf(mode.math);
      const int B = 3, T = 40, C = 64, Vp = 128, maxT = 48;
      std::vector<int> tokens(B * T);
      for (int& t : tokens) t = std::uniform_int_distribution<int>(0, 19)(rng);  // repeats
      auto wte = Random(Vp * C, rng), wpe = Random(maxT * C, rng), dout = Random(B * T * C, rng);
      auto dwte0 = Random(Vp * C, rng), dwpe0 = Random(maxT * C, rng);
      Buffer d_wte(wte.size(), ActType::kF32), d_wpe(wpe.size(), ActType::kF32),
          d_dout(dout.size(), act), out(B * T * C, act), d_dwte(wte.size(), ActType::kF32),
          d_dwpe(wpe.size(), ActType::kF32);
      d_wte.Upload(&wte);
      d_wpe.Upload(&wpe);
      d_dout.Upload(&dout);
      d_dwte.Upload(&dwte0);
      d_dwpe.Upload(&dwpe0);
      const DeviceTokens d_tokens(tokens);
      CUDA_REQUIRE(EncoderForward(act, out.get(), d_tokens.tokens(), d_wte.f(), d_wpe.f(), B, T, C,
                                  nullptr));
      std::vector<double> out_ref(B * T * C), dwte_ref(dwte0.begin(), dwte0.end()),
          dwpe_ref(dwpe0.begin(), dwpe0.end());
      for (int r = 0; r < B * T; ++r) {
        for (int c = 0; c < C; ++c) {
          out_ref[size_t(r) * C + c] = double(wte[tokens[r] * C + c]) + wpe[(r % T) * C + c];
          dwte_ref[tokens[r] * C + c] += dout[size_t(r) * C + c];
          dwpe_ref[(r % T) * C + c] += dout[size_t(r) * C + c];
        }
      }
      RequireClose(out.Download(), out_ref, mode.tolerance, "embeddings");
      CUDA_REQUIRE(EncoderBackward(act, d_dwte.f(), d_dwpe.f(), GradWrite::kAdd, d_dout.get(),
                                   d_tokens.group_tokens(), d_tokens.group_starts(),
                                   d_tokens.positions(), d_tokens.groups(), B, T, C, nullptr));
      RequireClose(d_dwte.Download(), dwte_ref, 1e-6, "dwte (accumulated)");
      RequireClose(d_dwpe.Download(), dwpe_ref, 1e-6, "dwpe (accumulated)");
    }
  }
}

TEST_CASE(
    "AdamW over runs in one launch matches the CPU; the bf16 copy is the rounded weights; "
    "gaps between runs stay untouched",
    "[adamw]") {
  std::mt19937 rng(Seed());
  const size_t n = 4 * kAdamWChunkFloats;
  // A long decayed run split over several blocks (its length not a
  // multiple of 4), a short undecayed one, a gap, and a run that starts off
  // a 16-byte boundary (in the second section: the scalar path).
  for (const unsigned long long odd_begin : {0ull, 1ull}) {
    SECTION(odd_begin ? "unaligned run" : "aligned runs") {
      const std::vector<AdamWChunk> runs = {
          {0, 2 * kAdamWChunkFloats + 101, 1},
          {2 * kAdamWChunkFloats + 104, 300, 0},
          {2 * kAdamWChunkFloats + 1024 + odd_begin, kAdamWChunkFloats - 16, 1}};
      auto params = Random(n, rng), m = Random(n, rng, 0.01f), v = Random(n, rng, 0.01f),
           grads = Random(n, rng);
      for (float& x : v) x = std::fabs(x);
      AdamWHyper hyper;
      hyper.weight_decay = 0.1f;
      hyper.grad_scale = 0.5f;
      Buffer d_params(n, ActType::kF32), d_m(n, ActType::kF32), d_v(n, ActType::kF32),
          d_grads(n, ActType::kF32), copy(n, ActType::kBf16);
      d_params.Upload(&params);
      d_m.Upload(&m);
      d_v.Upload(&v);
      d_grads.Upload(&grads);
      const std::vector<AdamWChunk> chunks = SplitAdamWRuns(runs);
      REQUIRE(chunks.size() == 5);
      AdamWChunk* d_chunks = nullptr;
      REQUIRE(cudaMalloc(&d_chunks, chunks.size() * sizeof(AdamWChunk)) == cudaSuccess);
      REQUIRE(cudaMemcpy(d_chunks, chunks.data(), chunks.size() * sizeof(AdamWChunk),
                         cudaMemcpyHostToDevice) == cudaSuccess);
      CUDA_REQUIRE(AdamWUpdateChunks(
          d_params.f(), d_m.f(), d_v.f(), d_grads.f(), static_cast<uint16_t*>(copy.get()), d_chunks,
          static_cast<int>(chunks.size()), odd_begin == 0, hyper, 3, nullptr));
      const std::vector<float> before = params;
      for (const AdamWChunk& run : runs) {
        AdamWHyper run_hyper = hyper;
        if (!run.decay) run_hyper.weight_decay = 0.0f;
        AdamWUpdateCpu(params.data() + run.begin, m.data() + run.begin, v.data() + run.begin,
                       grads.data() + run.begin, run.count, run_hyper, 3);
      }
      const std::vector<float> got = d_params.Download();
      RequireClose(got, AsDoubles(params), 1e-6, "params");
      RequireClose(d_m.Download(), AsDoubles(m), 1e-6, "m");
      RequireClose(d_v.Download(), AsDoubles(v), 1e-6, "v");
      const std::vector<float> bf16 = copy.Download();
      std::vector<bool> in_run(n, false);
      for (const AdamWChunk& run : runs) {
        for (size_t i = run.begin; i < run.begin + run.count; ++i) in_run[i] = true;
      }
      for (size_t i = 0; i < n; ++i) {
        INFO("element " << i);
        if (in_run[i]) {
          REQUIRE(bf16[i] == FromBf16(Bf16Bits(got[i])));
        } else {
          REQUIRE(got[i] == before[i]);  // a gap: not written
          REQUIRE(std::isnan(bf16[i]));  // still the poison
        }
      }
      cudaFree(d_chunks);
    }
  }
}

TEST_CASE("the bf16 casts give kernels/bf16.h's bits, both ways, on any length", "[cast]") {
  std::mt19937 rng(Seed());
  // Odd lengths, so the last block is partial; every fp32 bit pattern
  // class: random finite values of every exponent, ties, infinities, NaN.
  for (const size_t n : {size_t{1}, size_t{1000}, size_t{65537}}) {
    INFO("n " << n);
    std::uniform_int_distribution<uint32_t> any_bits;
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits = any_bits(rng);
      if (i % 7 == 1) bits = (bits & 0xffff0000u) | 0x8000u;  // a tie
      if (i % 11 == 2) bits = 0x7f800000u;                    // infinity
      if (i % 13 == 3) bits = 0x7fc00001u;                    // a NaN
      std::memcpy(&in[i], &bits, 4);
    }
    float* d_in = nullptr;
    uint16_t* d_half = nullptr;
    float* d_back = nullptr;
    REQUIRE(cudaMalloc(&d_in, n * 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_half, n * 2) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_back, n * 4) == cudaSuccess);
    REQUIRE(cudaMemset(d_back, 0xff, n * 4) == cudaSuccess);  // poison
    REQUIRE(cudaMemcpy(d_in, in.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    CUDA_REQUIRE(CastToBf16(d_half, d_in, n, nullptr));
    CUDA_REQUIRE(CastFromBf16(d_back, d_half, n, nullptr));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<uint16_t> half(n);
    std::vector<float> back(n);
    REQUIRE(cudaMemcpy(half.data(), d_half, n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(back.data(), d_back, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (size_t i = 0; i < n; ++i) {
      INFO("element " << i << " = " << in[i]);
      if (std::isnan(in[i])) {
        REQUIRE(std::isnan(FromBf16(half[i])));
        REQUIRE(std::isnan(back[i]));
        continue;
      }
      REQUIRE(half[i] == Bf16Bits(in[i]));
      uint32_t got_bits, want_bits;
      const float want = FromBf16(half[i]);
      std::memcpy(&got_bits, &back[i], 4);
      std::memcpy(&want_bits, &want, 4);
      REQUIRE(got_bits == want_bits);
    }
    cudaFree(d_in);
    cudaFree(d_half);
    cudaFree(d_back);
  }
}

#ifndef MUSTER_SIMT  // cuBLASLt: a GPU only
TEST_CASE("every kernel gives the same bits on every run", "[determinism]") {
  std::mt19937 rng(Seed());
  const ActType act = ActType::kBf16;
  auto gemm = MakeGemm(GemmMath::kBf16);
  const int B = 4, T = 256, C = 256, NH = 4, BT = B * T, V = 5000, Vp = 5120;
  auto qkv = Random(BT * 3 * C, rng), dout = Random(BT * C, rng), w = Random(C, rng),
       logits = Random(size_t(BT) * Vp, rng, 4.0f);
  Buffer d_qkv(qkv.size(), act), d_dout(dout.size(), act), d_w(C, ActType::kF32);
  d_qkv.Upload(&qkv);
  d_dout.Upload(&dout);
  d_w.Upload(&w);
  std::vector<int> targets(BT);
  for (int& t : targets) t = std::uniform_int_distribution<int>(0, V - 1)(rng);
  int* d_targets = nullptr;
  REQUIRE(cudaMalloc(&d_targets, BT * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_targets, targets.data(), BT * sizeof(int), cudaMemcpyHostToDevice) ==
          cudaSuccess);

  auto run = [&] {
    std::vector<std::vector<uint8_t>> results;
    Buffer out(BT * C, act), att(size_t(B) * NH * T * T, act),
        scores(size_t(B) * NH * T * T, ActType::kF32), dqkv(qkv.size(), act);
    CUDA_REQUIRE(
        AttentionForward(*gemm, out.get(), att.get(), scores.f(), d_qkv.get(), B, T, C, NH));
    results.push_back(out.Bytes());
    CUDA_REQUIRE(AttentionBackward(*gemm, dqkv.get(), scores.f(), att.get(), d_dout.get(),
                                   d_qkv.get(), B, T, C, NH));
    results.push_back(dqkv.Bytes());
    // Flash attention (C / NH = 64), bf16 and tf32.
    REQUIRE(FlashAttentionSupports(C, NH));
    Buffer lse(size_t(B) * NH * T, ActType::kF32),
        delta(std::max(FlashAttentionBackwardScratchFloats(FlashMath::kBf16, B, T, NH),
                       FlashAttentionBackwardScratchFloats(FlashMath::kTf32, B, T, NH)),
              ActType::kF32);
    CUDA_REQUIRE(FlashAttentionForward(FlashMath::kBf16, out.get(), lse.f(), d_qkv.get(), B, T, C,
                                       NH, nullptr));
    results.push_back(out.Bytes());
    results.push_back(lse.Bytes());
    CUDA_REQUIRE(FlashAttentionBackward(FlashMath::kBf16, dqkv.get(), delta.f(), d_dout.get(),
                                        out.get(), d_qkv.get(), lse.f(), B, T, C, NH, nullptr));
    results.push_back(dqkv.Bytes());
    Buffer qkv32(qkv.size(), ActType::kF32), dout32(dout.size(), ActType::kF32),
        out32(BT * C, ActType::kF32), dqkv32(qkv.size(), ActType::kF32);
    std::vector<float> qkv_copy = qkv, dout_copy = dout;
    qkv32.Upload(&qkv_copy);
    dout32.Upload(&dout_copy);
    CUDA_REQUIRE(FlashAttentionForward(FlashMath::kTf32, out32.get(), lse.f(), qkv32.get(), B, T, C,
                                       NH, nullptr));
    results.push_back(out32.Bytes());
    results.push_back(lse.Bytes());
    CUDA_REQUIRE(FlashAttentionBackward(FlashMath::kTf32, dqkv32.get(), delta.f(), dout32.get(),
                                        out32.get(), qkv32.get(), lse.f(), B, T, C, NH, nullptr));
    results.push_back(dqkv32.Bytes());
    Buffer dinp(BT * C, act), dw(C, ActType::kF32), db(C, ActType::kF32), mean(BT, ActType::kF32),
        rstd(BT, ActType::kF32), ln(BT * C, act),
        scratch(LayerNormBackwardScratchFloats(BT, C), ActType::kF32);
    CUDA_REQUIRE(cudaMemset(dinp.get(), 0, BT * C * 2));
    CUDA_REQUIRE(cudaMemset(dw.get(), 0, C * 4));
    CUDA_REQUIRE(cudaMemset(db.get(), 0, C * 4));
    CUDA_REQUIRE(LayerNormForward(act, ln.get(), mean.f(), rstd.f(), nullptr, out.get(), nullptr,
                                  d_w.f(), d_w.f(), BT, C, nullptr));
    CUDA_REQUIRE(LayerNormBackward(act, dinp.get(), dw.f(), db.f(), GradWrite::kAdd, d_dout.get(),
                                   out.get(), d_w.f(), mean.f(), rstd.f(), BT, C, scratch.f(),
                                   nullptr));
    results.push_back(dinp.Bytes());
    results.push_back(dw.Bytes());
    Buffer bias_grad(3 * C, ActType::kF32),
        bias_scratch(Gemm::BiasGradScratchFloats(BT, 3 * C), ActType::kF32);
    CUDA_REQUIRE(cudaMemset(bias_grad.get(), 0, 3 * C * 4));
    CUDA_REQUIRE(gemm->BackwardBias(bias_grad.f(), GradWrite::kAdd, dqkv.get(), BT, 3 * C,
                                    bias_scratch.f()));
    results.push_back(bias_grad.Bytes());
    Buffer d_logits(logits.size(), act), losses(BT, ActType::kF32);
    std::vector<float> copy = logits;
    d_logits.Upload(&copy);
    CUDA_REQUIRE(ClassifierForward(act, losses.f(), d_logits.get(), d_targets, 1.0f / BT, true, BT,
                                   V, Vp, nullptr));
    results.push_back(losses.Bytes());
    results.push_back(d_logits.Bytes());
    return results;
  };
  const auto first = run();
  const auto second = run();
  for (size_t i = 0; i < first.size(); ++i) {
    INFO("result " << i);
    CHECK(first[i] == second[i]);
  }
  cudaFree(d_targets);
}
#endif  // MUSTER_SIMT

}  // namespace
}  // namespace muster::kernels::fast
