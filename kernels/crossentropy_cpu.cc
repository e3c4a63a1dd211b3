#include "kernels/cpu_parallel.h"
#include "kernels/crossentropy.h"

namespace muster::kernels {

namespace {

// Rows [begin, end), in clones so that their loops use the widest vectors
// there are.
MUSTER_CPU_CLONES void ForwardRows(float* losses, float* lse, const float* logits,
                                   const int* targets, long begin, long end, int V, int Vp) {
  for (long row = begin; row < end; ++row) {
    losses[row] = CrossEntropyRowForward(lse + row, logits + row * Vp, V, targets[row]);
  }
}

MUSTER_CPU_CLONES void BackwardRows(float* dlogits, const float* logits, const float* lse,
                                    const int* targets, float dloss, long begin, long end, int V,
                                    int Vp) {
  for (long row = begin; row < end; ++row) {
    const float* logits_row = logits + row * Vp;
    float* dlogits_row = dlogits + row * Vp;
    MUSTER_SIMD
    for (int v = 0; v < Vp; ++v) {
      dlogits_row[v] = CrossEntropyBackwardElem(logits_row[v], lse[row], v, V, targets[row], dloss);
    }
  }
}

}  // namespace

void CrossEntropyForwardCpu(float* losses, float* lse, const float* logits, const int* targets,
                            size_t N, int V, int Vp) {
  cpu::ParallelForBlocks(static_cast<long>(N), cpu::kRowsPerTask, [=](long begin, long end) {
    ForwardRows(losses, lse, logits, targets, begin, end, V, Vp);
  });
}

void CrossEntropyBackwardCpu(float* dlogits, const float* logits, const float* lse,
                             const int* targets, float dloss, size_t N, int V, int Vp) {
  cpu::ParallelForBlocks(static_cast<long>(N), cpu::kRowsPerTask, [=](long begin, long end) {
    BackwardRows(dlogits, logits, lse, targets, dloss, begin, end, V, Vp);
  });
}

}  // namespace muster::kernels
