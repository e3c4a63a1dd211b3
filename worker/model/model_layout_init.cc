// GPT-2 initialisation with a portable generator: splitmix64 for uniform
// bits, Box–Muller for normals. std::normal_distribution is not used
// because its algorithm differs between standard libraries.
#include <algorithm>
#include <cmath>

#include "worker/model/model_layout.h"

namespace muster::worker::layout {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr double kInitStd = 0.02;  // GPT-2's std for matrices and embeddings

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Standard normals, two per Box–Muller draw.
class NormalStream {
 public:
  explicit NormalStream(uint64_t key) : state_(key) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // u1 in (0, 1] so log(u1) is finite; u2 in [0, 1). 53 bits each.
    const double u1 = static_cast<double>((SplitMix64(&state_) >> 11) + 1) * 0x1.0p-53;
    const double u2 = static_cast<double>(SplitMix64(&state_) >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    spare_ = radius * std::sin(2.0 * kPi * u2);
    has_spare_ = true;
    return radius * std::cos(2.0 * kPi * u2);
  }

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// A stream key that differs for every (seed, stage, tensor).
uint64_t StreamKey(uint64_t seed, int stage, int tensor) {
  uint64_t mix = seed;
  uint64_t key = SplitMix64(&mix);
  mix = key ^ (static_cast<uint64_t>(stage) << 32 | static_cast<uint32_t>(tensor));
  return SplitMix64(&mix);
}

}  // namespace

void InitialStageParams(const ModelConfig& config, const std::vector<Stage>& stages, int stage,
                        uint64_t seed, float* out) {
  const double residual_std = kInitStd / std::sqrt(2.0 * config.layers);
  const std::vector<TensorView>& tensors = stages[stage].tensors;
  std::fill(out, out + stages[stage].size, 0.0f);
  for (int t = 0; t < static_cast<int>(tensors.size()); ++t) {
    const TensorView& view = tensors[t];
    float* values = out + view.offset;
    const std::string& name = view.name;
    if (name == "ln1w" || name == "ln2w" || name == "lnfw") {
      for (size_t i = 0; i < view.size; ++i) values[i] = 1.0f;
      continue;
    }
    if (name.back() == 'b') continue;  // biases (ln1b, qkvb, ...) stay zero
    const double std_dev = (name == "attprojw" || name == "fcprojw") ? residual_std : kInitStd;
    // wte's padded rows (>= V) are never looked up and get no gradient;
    // they stay zero.
    const size_t count = name == "wte" ? static_cast<size_t>(config.vocab) * config.dim : view.size;
    NormalStream normals(StreamKey(seed, stage, t));
    for (size_t i = 0; i < count; ++i) values[i] = static_cast<float>(std_dev * normals.Next());
  }
}

std::vector<float> InitialParams(const ModelConfig& config, const std::vector<Stage>& stages,
                                 uint64_t seed) {
  std::vector<float> host(TotalFloats(stages));
  size_t stage_offset = 0;
  for (int s = 0; s < static_cast<int>(stages.size()); ++s) {
    InitialStageParams(config, stages, s, seed, host.data() + stage_offset);
    stage_offset += stages[s].size;
  }
  return host;
}

}  // namespace muster::worker::layout
