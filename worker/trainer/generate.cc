#include "worker/trainer/generate.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::worker {
namespace {

// Index drawn from softmax(logits[0..V) / temperature), or the argmax when
// temperature is 0. `coin` is uniform in [0, 1).
int SampleToken(const std::vector<float>& logits, int V, float temperature, double coin) {
  int best = 0;
  for (int v = 1; v < V; ++v) {
    if (logits[v] > logits[best]) best = v;
  }
  if (temperature == 0.0f) return best;
  std::vector<double> weights(V);
  double total = 0;
  for (int v = 0; v < V; ++v) {
    // Subtracting the max keeps exp() finite.
    weights[v] = std::exp((static_cast<double>(logits[v]) - logits[best]) / temperature);
    total += weights[v];
  }
  double target = coin * total, cumulative = 0;
  for (int v = 0; v < V; ++v) {
    cumulative += weights[v];
    if (target < cumulative) return v;
  }
  return V - 1;  // rounding left target == total
}

}  // namespace

absl::Status CheckGenerateOptions(const ModelConfig& config, const GenerateOptions& options) {
  if (config.vocab != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("generate decodes bytes: it needs model.vocab 256, not ", config.vocab));
  }
  if (options.tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tokens ", options.tokens, " is negative"));
  }
  if (!(options.temperature >= 0) || !std::isfinite(options.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat("--temperature ", options.temperature,
                                                   ": expected a finite number >= 0 (0: greedy)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GenerateText(GptModel* model, const GenerateOptions& options) {
  const ModelConfig& config = model->config();
  if (absl::Status checked = CheckGenerateOptions(config, options); !checked.ok()) return checked;
  std::vector<int> tokens;
  for (unsigned char byte : options.prompt) tokens.push_back(byte);
  if (tokens.empty()) tokens.push_back('\n');

  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const int max_T = config.seq_len;
  for (int i = 0; i < options.tokens; ++i) {
    int T = std::min<int>(static_cast<int>(tokens.size()), max_T);
    const int* window = tokens.data() + tokens.size() - T;  // (1, T)
    model->Forward(window, nullptr, 1, T);
    std::vector<float> logits = model->Logits(0, T - 1);  // (Vp,)
    tokens.push_back(SampleToken(logits, config.vocab, options.temperature, uniform(rng)));
  }
  std::string text = options.prompt;
  size_t first_new = tokens.size() - options.tokens;
  for (size_t i = first_new; i < tokens.size(); ++i) text.push_back(static_cast<char>(tokens[i]));
  return text;
}

}  // namespace muster::worker
