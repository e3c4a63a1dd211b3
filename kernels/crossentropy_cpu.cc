#include "kernels/cpu_parallel.h"
#include "kernels/crossentropy.h"

namespace muster::kernels {

void CrossEntropyForwardCpu(float* losses, float* lse, const float* logits,
                            const int* targets, size_t N, int V, int Vp) {
  cpu::ParallelFor(static_cast<long>(N), [=](long row) {
    losses[row] =
        CrossEntropyRowForward(lse + row, logits + row * Vp, V, targets[row]);
  });
}

void CrossEntropyBackwardCpu(float* dlogits, const float* logits,
                             const float* lse, const int* targets, float dloss,
                             size_t N, int V, int Vp) {
  cpu::ParallelFor(static_cast<long>(N), [=](long row) {
    const float* logits_row = logits + row * Vp;
    float* dlogits_row = dlogits + row * Vp;
    for (int v = 0; v < Vp; ++v) {
      dlogits_row[v] = CrossEntropyBackwardElem(logits_row[v], lse[row], v, V,
                                                targets[row], dloss);
    }
  });
}

}  // namespace muster::kernels
