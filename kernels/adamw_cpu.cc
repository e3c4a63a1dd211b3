#include "kernels/adamw.h"
#include "kernels/cpu_parallel.h"

namespace muster::kernels {
namespace {

// params, m, v, grads [begin, end): element-wise, so the bits do not depend
// on the split or on the clone.
MUSTER_CPU_CLONES void AdamWRange(float* params, float* m, float* v, const float* grads, long begin,
                                  long end, AdamWHyper hyper, float bias_correction1,
                                  float bias_correction2) {
#pragma omp simd
  for (long i = begin; i < end; ++i) {
    AdamWElem(params + i, m + i, v + i, grads[i], hyper, bias_correction1, bias_correction2);
  }
}

}  // namespace

void AdamWUpdateCpu(float* params, float* m, float* v, const float* grads, size_t n,
                    const AdamWHyper& hyper, int step) {
  const float bias_correction1 = AdamWBiasCorrection(hyper.beta1, step);
  const float bias_correction2 = AdamWBiasCorrection(hyper.beta2, step);
  const AdamWHyper h = hyper;
  cpu::ParallelForRanges(static_cast<long>(n), [=](long begin, long end) {
    AdamWRange(params, m, v, grads, begin, end, h, bias_correction1, bias_correction2);
  });
}

}  // namespace muster::kernels
