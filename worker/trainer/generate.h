// Sampling text from a trained model, byte-level: with model.vocab 256 a
// token is a byte, so the prompt's bytes are its tokens and sampled tokens
// are printed as bytes.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "worker/model/model.h"

namespace muster::worker {

struct GenerateOptions {
  std::string prompt;        // "" starts from a newline
  int tokens = 200;          // new tokens to sample
  float temperature = 0.8f;  // 0: greedy (argmax)
  uint64_t seed = 1337;
};

// Returns the prompt followed by `tokens` sampled bytes. Each new token is
// sampled from softmax(logits / temperature) over the V real entries at the
// last position of a window of at most seq_len tokens (the model has no KV
// cache: every token reruns the window). The same model, options and seed
// give the same text. INVALID_ARGUMENT unless model vocab is 256, or if
// tokens < 0 or temperature < 0.
absl::StatusOr<std::string> GenerateText(GptModel* model, const GenerateOptions& options);
// GenerateText's checks of its input, before any model is built:
// INVALID_ARGUMENT for a model.vocab other than 256, negative --tokens, and
// a --temperature that is negative or not finite.
absl::Status CheckGenerateOptions(const ModelConfig& config, const GenerateOptions& options);

}  // namespace muster::worker
