#include "kernels/cpu_parallel.h"
#include "kernels/residual.h"

namespace muster::kernels {

void ResidualForwardCpu(float* out, const float* inp1, const float* inp2, size_t n) {
  cpu::ParallelFor(static_cast<long>(n),
                   [=](long i) { out[i] = ResidualForwardElem(inp1[i], inp2[i]); });
}

void ResidualBackwardCpu(float* dinp1, float* dinp2, const float* dout, size_t n) {
  cpu::ParallelFor(static_cast<long>(n),
                   [=](long i) { ResidualBackwardElem(dinp1 + i, dinp2 + i, dout[i]); });
}

}  // namespace muster::kernels
