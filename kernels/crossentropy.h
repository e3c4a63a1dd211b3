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

#include "kernels/hd.h"

namespace muster::kernels {

// One row: logits_row (Vp, only :V read). Writes *lse, returns the loss.
MUSTER_HD float CrossEntropyRowForward(float* lse, const float* logits_row,
                                       int V, int target) {
  float max_logit = logits_row[0];
  for (int v = 1; v < V; ++v) max_logit = fmaxf(max_logit, logits_row[v]);
  float sum = 0.0f;  // shifted by the max so expf cannot overflow
  for (int v = 0; v < V; ++v) sum += expf(logits_row[v] - max_logit);
  const float row_lse = max_logit + logf(sum);
  *lse = row_lse;
  return row_lse - logits_row[target];
}

// One logit in column v of a row: d loss / d logit, times dloss (the
// gradient of the objective with respect to this row's loss, e.g. 1/(B*T)
// for a mean). Zero in the padding.
MUSTER_HD float CrossEntropyBackwardElem(float logit, float lse, int v, int V,
                                         int target, float dloss) {
  if (v >= V) return 0.0f;
  const float prob = expf(logit - lse);
  const float indicator = v == target ? 1.0f : 0.0f;
  return (prob - indicator) * dloss;
}

// ---- CPU back end (host pointers) ----
void CrossEntropyForwardCpu(float* losses, float* lse, const float* logits,
                            const int* targets, size_t N, int V, int Vp);
// Every row's loss gets the same upstream gradient dloss.
void CrossEntropyBackwardCpu(float* dlogits, const float* logits,
                             const float* lse, const int* targets, float dloss,
                             size_t N, int V, int Vp);

// ---- CUDA back end (--config=cuda only) ----
// Device pointers, enqueued on `stream` (a cudaStream_t). Returns 0 or the
// cudaError_t of the launch.
int CrossEntropyForwardCuda(float* losses, float* lse, const float* logits,
                            const int* targets, size_t N, int V, int Vp,
                            void* stream);
int CrossEntropyBackwardCuda(float* dlogits, const float* logits,
                             const float* lse, const int* targets, float dloss,
                             size_t N, int V, int Vp, void* stream);

}  // namespace muster::kernels
