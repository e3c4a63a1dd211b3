// Fused softmax + cross-entropy over a padded vocabulary, the fused form of
// llm.c's softmax_forward / crossentropy_forward /
// crossentropy_softmax_backward:
//   loss[row] = logsumexp(logits[row, :V]) - logits[row, target[row]]
// Shapes: N = B*T rows, V real vocabulary, Vp >= V padded vocabulary.
//   logits, dlogits (N, Vp); targets (N) int32 in [0, V); losses, lse (N).
// Columns V..Vp-1 are padding: ignored by the forward pass, and given zero
// gradient by the backward pass.
//
// Memory: instead of llm.c's probs (N, Vp), the forward pass saves one
// log-sum-exp per row, and the backward pass recomputes
//   probs = exp(logits - lse).
// Unlike the other backward functions, the backward pass OVERWRITES dlogits
// (the logits feed nothing else), and dlogits may alias logits, so the
// gradient can replace the logits in place.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/exp_math.h"
#include "kernels/hd.h"

namespace muster::kernels {

// Exponentials per chunk of a row: computed side by side, then summed in
// column order.
constexpr int kCrossEntropyChunk = 64;

// One row: logits_row (Vp, only :V read). Writes *lse, returns the loss.
MUSTER_HD float CrossEntropyRowForward(float* lse, const float* logits_row, int V, int target) {
  float max_logit = logits_row[0];
  MUSTER_SIMD_MAX(max_logit)
  for (int v = 1; v < V; ++v) {
    max_logit = logits_row[v] > max_logit ? logits_row[v] : max_logit;
  }
  // Shifted by the max: every exponent is <= 0, so none can overflow.
  float sum = 0.0f;
  for (int first = 0; first < V; first += kCrossEntropyChunk) {
    const int count = V - first < kCrossEntropyChunk ? V - first : kCrossEntropyChunk;
    float exps[kCrossEntropyChunk];
    MUSTER_SIMD
    for (int i = 0; i < count; ++i) {
      exps[i] = ExpNonPositive(logits_row[first + i] - max_logit);
    }
    for (int i = 0; i < count; ++i) sum += exps[i];
  }
  const float row_lse = max_logit + logf(sum);
  *lse = row_lse;
  return row_lse - logits_row[target];
}

// One logit in column v of a row: d loss / d logit, times dloss (the
// gradient of the objective with respect to this row's loss, e.g. 1/(B*T)
// for a mean). Zero in the padding. logit <= lse (lse is the row's max
// plus the log of a sum >= 1), so the exponent is <= 0.
MUSTER_HD float CrossEntropyBackwardElem(float logit, float lse, int v, int V, int target,
                                         float dloss) {
  const float prob = ExpNonPositive(logit - lse);
  const float indicator = v == target ? 1.0f : 0.0f;
  return v < V ? (prob - indicator) * dloss : 0.0f;
}

// ---- CPU back end (host pointers) ----
void CrossEntropyForwardCpu(float* losses, float* lse, const float* logits, const int* targets,
                            size_t N, int V, int Vp);
// Every row's loss gets the same upstream gradient dloss.
void CrossEntropyBackwardCpu(float* dlogits, const float* logits, const float* lse,
                             const int* targets, float dloss, size_t N, int V, int Vp);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int CrossEntropyForwardCuda(float* losses, float* lse, const float* logits, const int* targets,
                            size_t N, int V, int Vp, void* stream);
int CrossEntropyBackwardCuda(float* dlogits, const float* logits, const float* lse,
                             const int* targets, float dloss, size_t N, int V, int Vp,
                             void* stream);

}  // namespace muster::kernels
