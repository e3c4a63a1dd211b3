// The fused classifier (llm.c's fused_classifier): one pass over each row
// of logits gives the row's cross-entropy and, in the same kernel, the
// logits' gradient written over the logits, so no (BT, Vp) probability
// tensor is ever stored.
#pragma once

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

// logits (BT, Vp) act; targets (BT) ids < V; losses (BT) fp32 =
// logsumexp(logits[:V]) - logits[target]. With write_grad, logits become
// d loss / d logits = (softmax - onehot(target)) * dloss, and 0 in the
// padded columns [V, Vp). The softmax and sums are fp32.
int ClassifierForward(ActType act, float* losses, void* logits, const int* targets, float dloss,
                      bool write_grad, int BT, int V, int Vp, void* stream);

// The kernel ClassifierForward runs for rows of Vp elements of `act` on
// the current device: the row read twice from global memory, staged in
// shared memory (two blocks an SM where that fits), or held in registers.
// Tests assert it: a kernel that silently fell back gives right answers.
enum class ClassifierPath { kTwoReads, kStaged, kRegisters };
ClassifierPath ClassifierPathFor(ActType act, int Vp);

}  // namespace muster::kernels::fast
