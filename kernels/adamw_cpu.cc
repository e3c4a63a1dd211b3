#include "kernels/adamw.h"
#include "kernels/cpu_parallel.h"

namespace muster::kernels {

void AdamWUpdateCpu(float* params, float* m, float* v, const float* grads,
                    size_t n, const AdamWHyper& hyper, int step) {
  const float bias_correction1 = AdamWBiasCorrection(hyper.beta1, step);
  const float bias_correction2 = AdamWBiasCorrection(hyper.beta2, step);
  cpu::ParallelFor(static_cast<long>(n), [=, &hyper](long i) {
    AdamWElem(params + i, m + i, v + i, grads[i], hyper, bias_correction1,
              bias_correction2);
  });
}

}  // namespace muster::kernels
