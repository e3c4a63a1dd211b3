// The CPU emulation of kernels/simt: flash attention's kernels under
// other thread schedules than round robin (one warp far ahead of the
// others, or a shuffled order), which must still match the CPU back end
// and give the same bits; a warp-wide instruction that lanes skip is a
// reported deadlock; cp.async data is hidden until waited for.
// tests/kernels:fast_simt_test runs fast_cuda_test's cases on the same
// emulation. Needs the CUDA headers, not a GPU: manual, run by
// scripts/test.sh after the CUDA build.
#include "kernels/simt/simt.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/fast/flash_attention.h"
#include "tests/kernels/flash_tilings.h"

namespace muster::kernels::fast {
namespace {

std::vector<float> Random(size_t n, std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Activations as the kernels store them: bf16 bits or fp32, in host
// memory, poisoned (NaN) until written.
class Act {
 public:
  Act(size_t n, bool bf16) : bf16_(bf16), bytes_(n * (bf16 ? 2 : 4), 0xff), n_(n) {}
  void* get() { return bytes_.data(); }
  // Stores `values`, rounded to bf16 in place if the storage is bf16, so
  // the reference sees exactly what the kernels read.
  void Set(std::vector<float>* values) {
    for (size_t i = 0; i < n_; ++i) {
      if (bf16_) {
        const uint16_t bits = Bf16FromFloat((*values)[i]);
        std::memcpy(&bytes_[2 * i], &bits, 2);
        (*values)[i] = FloatFromBf16(bits);
      } else {
        std::memcpy(&bytes_[4 * i], &(*values)[i], 4);
      }
    }
  }
  std::vector<float> Get() const {
    std::vector<float> values(n_);
    for (size_t i = 0; i < n_; ++i) {
      if (bf16_) {
        uint16_t bits;
        std::memcpy(&bits, &bytes_[2 * i], 2);
        values[i] = FloatFromBf16(bits);
      } else {
        std::memcpy(&values[i], &bytes_[4 * i], 4);
      }
    }
    return values;
  }

 private:
  bool bf16_;
  std::vector<unsigned char> bytes_;
  size_t n_;
};

// ||got - want|| / ||want||; every element must be finite.
void RequireClose(const std::vector<float>& got, const std::vector<double>& want, double bound,
                  const std::string& what) {
  REQUIRE(got.size() == want.size());
  double diff = 0, norm = 0;
  size_t first_bad = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && first_bad == got.size()) first_bad = i;
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  INFO(what << ": element " << first_bad << " of " << got.size() << " is not finite");
  REQUIRE(first_bad == got.size());
  const double error = std::sqrt(diff / norm);
  INFO(what << ": relative error " << error << ", bound " << bound);
  CHECK(error < bound);
}

// The index of the first element whose bits differ, or -1.
long FirstDifference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) return static_cast<long>(i);
  }
  return -1;
}

std::vector<double> AsDoubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

struct Outputs {
  std::vector<float> out, lse, dqkv;
};

// Flash attention with `math` and `tiling` on the emulation, against the
// CPU back end (kernels/attention.h): out, each row's log2-sum-exp, dqkv,
// and each of dq, dk, dv alone. B=2, C=128, NH=2 (head size 64). Bounds as
// fast_cuda_test's. Returns what the kernels wrote.
Outputs FlashCase(FlashMath math, const FlashTiling& tiling, int T, uint32_t seed) {
  const bool bf16 = math == FlashMath::kBf16;
  const double out_bound = bf16 ? 1e-2 : 2e-3, lse_bound = bf16 ? 1e-3 : 5e-4,
               grad_bound = bf16 ? 2e-2 : 2e-3;
  const int B = 2, C = 128, NH = 2, hs = C / NH;
  REQUIRE(FlashAttentionSupports(C, NH));
  std::mt19937 rng(seed);
  std::vector<float> qkv = Random(size_t(B) * T * 3 * C, rng, 2.0f);
  std::vector<float> dout = Random(size_t(B) * T * C, rng, 1.0f);
  Act d_qkv(qkv.size(), bf16), d_dout(dout.size(), bf16);
  d_qkv.Set(&qkv);
  d_dout.Set(&dout);

  std::vector<float> out(size_t(B) * T * C), att(size_t(B) * NH * T * T), dpreatt(att.size()),
      dqkv(qkv.size(), 0.0f);
  AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
  AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                       NH);
  // Each row's log2-sum-exp from the CPU's own probabilities: att[t][0] =
  // exp(s_0 / sqrt(hs) - lse).
  std::vector<double> lse_ref(size_t(B) * NH * T);
  for (int b = 0; b < B; ++b) {
    const float* seq = &qkv[size_t(b) * T * 3 * C];
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        double s0 = 0;
        for (int d = 0; d < hs; ++d)
          s0 += double(seq[t * 3 * C + h * hs + d]) * seq[C + h * hs + d];
        const size_t row = (size_t(b) * NH + h) * T + t;
        lse_ref[row] = (s0 / std::sqrt(double(hs)) - std::log(att[row * T])) / std::log(2.0);
      }
    }
  }

  Act d_out(out.size(), bf16), d_dqkv(qkv.size(), bf16);
  std::vector<float> lse(size_t(B) * NH * T, NAN),
      scratch(FlashAttentionBackwardScratchFloats(math, B, T, NH, tiling), NAN);
  REQUIRE(FlashAttentionForward(math, d_out.get(), lse.data(), d_qkv.get(), B, T, C, NH, nullptr,
                                tiling) == 0);
  INFO(simt::LastErrorMessage());
  Outputs got{d_out.Get(), lse, {}};
  RequireClose(got.out, AsDoubles(out), out_bound, "out");
  RequireClose(got.lse, lse_ref, lse_bound, "log2-sum-exp");
  REQUIRE(FlashAttentionBackward(math, d_dqkv.get(), scratch.data(), d_dout.get(), d_out.get(),
                                 d_qkv.get(), lse.data(), B, T, C, NH, nullptr, tiling) == 0);
  got.dqkv = d_dqkv.Get();
  RequireClose(got.dqkv, AsDoubles(dqkv), grad_bound, "dqkv");
  for (int part = 0; part < 3; ++part) {
    std::vector<float> got_part;
    std::vector<double> want_part;
    for (size_t r = 0; r < size_t(B) * T; ++r) {
      for (int c = 0; c < C; ++c) {
        got_part.push_back(got.dqkv[r * 3 * C + part * C + c]);
        want_part.push_back(dqkv[r * 3 * C + part * C + c]);
      }
    }
    RequireClose(got_part, want_part, grad_bound, std::string("d") + "qkv"[part]);
  }
  return got;
}

// Other orders of the threads between their waits (simt::Schedule): one
// warp far ahead of the others, or a shuffled order. A kernel that reads
// shared memory another warp writes (or refills) without a barrier in
// between reads NaN or other data in some of them. Every tiling of both
// maths, at T = 200 (four key tiles, so each buffer is refilled), must
// match the CPU and give the round-robin run's bits.
TEST_CASE("flash attention gives the same bits whatever order its threads run in", "[order]") {
  const std::pair<const char*, simt::Schedule> schedules[] = {
      {"lowest first", simt::Schedule::kLowestFirst},
      {"highest first", simt::Schedule::kHighestFirst},
      {"shuffled", simt::Schedule::kShuffled}};
  for (const FlashMath math : {FlashMath::kBf16, FlashMath::kTf32}) {
    for (const auto& [name, tiling] : CompiledFlashTilings(math)) {
      SECTION(std::string(math == FlashMath::kBf16 ? "bf16 " : "tf32 ") + name) {
        simt::SetSchedule(simt::Schedule::kRoundRobin);
        const Outputs ordered = FlashCase(math, tiling, 200, 7);
        for (const auto& [schedule_name, schedule] : schedules) {
          INFO("schedule: " << schedule_name);
          simt::SetSchedule(schedule, 1);
          const Outputs other = FlashCase(math, tiling, 200, 7);
          CHECK(FirstDifference(other.out, ordered.out) == -1);
          CHECK(FirstDifference(other.lse, ordered.lse) == -1);
          CHECK(FirstDifference(other.dqkv, ordered.dqkv) == -1);
        }
        simt::SetSchedule(simt::Schedule::kRoundRobin);
      }
    }
  }
}

// ---- the emulation itself ----

// Half of each warp skips a shuffle the other half waits at.
void HalfWarpShuffle(float* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

TEST_CASE("the emulation reports a warp-wide instruction that lanes skip as a deadlock", "[simt]") {
  std::vector<float> out(64, 0.0f);
  const int status = simt::Launch(dim3(1), dim3(64), 0, [&] { HalfWarpShuffle(out.data()); });
  CHECK(status == static_cast<int>(cudaErrorLaunchFailure));
  CHECK(simt::LastError() == static_cast<int>(cudaErrorLaunchFailure));
  CHECK(simt::LastError() == 0);  // read once, then cleared
  INFO(simt::LastErrorMessage());
  CHECK(simt::LastErrorMessage().find("deadlock") != std::string::npos);
  CHECK(simt::LastErrorMessage().find("shfl.xor") != std::string::npos);
}

// Each thread copies 16 bytes into shared memory with cp.async and reads
// them back before waiting for the copy, and again after.
void CopyThenRead(const float* source, float* before, float* after) {
  float* shared = reinterpret_cast<float*>(simt::DynamicShared());
  const int i = threadIdx.x;
  simt::CpAsync16(shared + 4 * i, source + 4 * i, 16);
  simt::CpAsync16(shared + 4 * (i + 32), source, 0);  // zero-fill
  simt::CpAsyncCommit();
  before[i] = shared[4 * i];
  simt::CpAsyncWait(0);
  after[i] = shared[4 * i];
  after[32 + i] = shared[4 * (i + 32)];
}

TEST_CASE("the emulation delivers cp.async copies only when they are waited for", "[simt]") {
  std::vector<float> source(4 * 32), before(32, 0.0f), after(64, -1.0f);
  for (size_t i = 0; i < source.size(); ++i) source[i] = float(i);
  REQUIRE(simt::Launch(dim3(1), dim3(32), 64 * 16,
                       [&] { CopyThenRead(source.data(), before.data(), after.data()); }) == 0);
  for (int i = 0; i < 32; ++i) {
    CHECK(std::isnan(before[i]));
    CHECK(after[i] == float(4 * i));
    CHECK(after[32 + i] == 0.0f);
  }
}

}  // namespace
}  // namespace muster::kernels::fast
