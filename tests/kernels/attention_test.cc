#include "kernels/attention.h"

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

constexpr int B = 2, T = 5, C = 8, NH = 2, hs = C / NH;

struct Reference {
  std::vector<double> out, att;  // (B, T, C), (B, NH, T, T)
};

// Causal softmax(q k^T / sqrt(hs)) v per (batch, head), from the
// definition in double.
Reference ReferenceForward(const std::vector<double>& qkv) {
  Reference ref{std::vector<double>(B * T * C, 0.0), std::vector<double>(B * NH * T * T, 0.0)};
  auto at = [&](int b, int t, int part, int h, int i) {
    return qkv[(b * T + t) * 3 * C + part * C + h * hs + i];
  };
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        std::vector<double> weights(t + 1);
        double sum = 0;
        for (int t2 = 0; t2 <= t; ++t2) {
          double score = 0;
          for (int i = 0; i < hs; ++i) score += at(b, t, 0, h, i) * at(b, t2, 1, h, i);
          weights[t2] = std::exp(score / std::sqrt(double{hs}));
          sum += weights[t2];
        }
        for (int t2 = 0; t2 <= t; ++t2) {
          const double prob = weights[t2] / sum;
          ref.att[((b * NH + h) * T + t) * T + t2] = prob;
          for (int i = 0; i < hs; ++i) {
            ref.out[(b * T + t) * C + h * hs + i] += prob * at(b, t2, 2, h, i);
          }
        }
      }
    }
  }
  return ref;
}

TEST_CASE("attention forward matches causal softmax(q k^T / sqrt(hs)) v") {
  auto qkv = RandomFloats(B * T * 3 * C, 1, -2.0f, 2.0f);
  std::vector<float> out(B * T * C), att(B * NH * T * T, 7.0f);
  AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
  Reference ref = ReferenceForward(ToDouble(qkv));
  RequireClose(out, ref.out, 1e-5, 1e-6, "out");
  // Includes the masked future, which must read exactly zero.
  RequireClose(att, ref.att, 1e-5, 1e-7, "att");
}

TEST_CASE("attention backward matches finite differences and accumulates") {
  auto qkv = RandomFloats(B * T * 3 * C, 2, -2.0f, 2.0f);
  auto dout = RandomFloats(B * T * C, 3);
  std::vector<float> out(B * T * C), att(B * NH * T * T);
  AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
  const float prior = 0.75f;
  std::vector<float> dqkv(B * T * 3 * C, prior), dpreatt(B * NH * T * T, -9.0f);
  AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                       NH);
  auto want = FiniteDifferenceGradient(
      [&](const std::vector<double>& x) { return Dot(ReferenceForward(x).out, dout); },
      ToDouble(qkv));
  for (double& g : want) g += prior;
  RequireClose(dqkv, want, 1e-4, 1e-5, "dqkv");
}

TEST_CASE("attention's first position attends only to itself") {
  auto qkv = RandomFloats(B * T * 3 * C, 4);
  std::vector<float> out(B * T * C), att(B * NH * T * T);
  AttentionForwardCpu(out.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int b = 0; b < B; ++b) {
    for (int c = 0; c < C; ++c) {
      // out(b, 0) is v(b, 0) exactly: a softmax over one score is 1.
      REQUIRE(out[(b * T) * C + c] == qkv[(b * T) * 3 * C + 2 * C + c]);
    }
  }
}

// The CUDA kernels run the per-row loops of attention.h; the CPU runs GEMMs
// around the same softmax rows. Both must agree to float rounding.
TEST_CASE("the per-row loops the CUDA kernels run match the CPU path") {
  const int batch = 2, time = 70, channels = 48, heads = 3;
  const int head_size = channels / heads;
  auto qkv = RandomFloats(batch * time * 3 * channels, 10, -2.0f, 2.0f);
  auto dout = RandomFloats(batch * time * channels, 11);
  const size_t map_size = static_cast<size_t>(batch) * heads * time * time;
  std::vector<float> out(batch * time * channels), att(map_size), dpreatt(map_size),
      dqkv(qkv.size(), 0.25f);
  AttentionForwardCpu(out.data(), att.data(), qkv.data(), batch, time, channels, heads);
  AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), batch,
                       time, channels, heads);

  std::vector<float> row_out(out.size()), row_att(map_size, 7.0f), row_dpreatt(map_size, -9.0f),
      row_dqkv(qkv.size(), 0.25f);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const size_t qkv_at = AttentionQkvOffset(b, h, time, channels, head_size);
      const size_t out_at = AttentionOutOffset(b, h, time, channels, head_size);
      const size_t map_at = AttentionMapOffset(b, h, heads, time);
      for (int t = 0; t < time; ++t) {
        AttentionRowForward(row_out.data() + out_at, row_att.data() + map_at, qkv.data() + qkv_at,
                            t, time, channels, head_size);
      }
      for (int t = 0; t < time; ++t) {
        AttentionRowBackwardScores(row_dpreatt.data() + map_at, row_att.data() + map_at,
                                   qkv.data() + qkv_at, dout.data() + out_at, t, time, channels,
                                   head_size);
      }
      for (int t = 0; t < time; ++t) {
        AttentionRowBackwardInputs(row_dqkv.data() + qkv_at, row_dpreatt.data() + map_at,
                                   row_att.data() + map_at, qkv.data() + qkv_at,
                                   dout.data() + out_at, t, time, channels, head_size);
      }
    }
  }
  RequireClose(out, ToDouble(row_out), 1e-5, 1e-6, "out");
  RequireClose(att, ToDouble(row_att), 1e-5, 1e-7, "att");
  RequireClose(dqkv, ToDouble(row_dqkv), 1e-4, 1e-5, "dqkv");
}

TEST_CASE("attention is bitwise deterministic") {
  const int batch = 2, time = 48, channels = 64, heads = 4;
  auto qkv = RandomFloats(batch * time * 3 * channels, 5);
  auto dout = RandomFloats(batch * time * channels, 6);
  auto run = [&] {
    std::vector<float> out(batch * time * channels), att(batch * heads * time * time),
        dpreatt(att.size()), dqkv(qkv.size(), 0.0f);
    AttentionForwardCpu(out.data(), att.data(), qkv.data(), batch, time, channels, heads);
    AttentionBackwardCpu(dqkv.data(), dpreatt.data(), dout.data(), qkv.data(), att.data(), batch,
                         time, channels, heads);
    out.insert(out.end(), att.begin(), att.end());
    out.insert(out.end(), dqkv.begin(), dqkv.end());
    return out;
  };
  REQUIRE(BitwiseEqual(run(), run()));
}

}  // namespace
}  // namespace muster::kernels
