#include <algorithm>
#include <vector>

#include "kernels/cpu_parallel.h"
#include "kernels/grad_norm.h"

namespace muster::kernels {

double SumOfSquaresCpu(const float* x, size_t n) {
  const size_t chunks = (n + kSumOfSquaresChunk - 1) / kSumOfSquaresChunk;
  std::vector<double> chunk_sums(chunks);
  double* sums = chunk_sums.data();
  cpu::ParallelFor(static_cast<long>(chunks), [=](long chunk) {
    const size_t begin = chunk * kSumOfSquaresChunk;
    sums[chunk] = SumOfSquaresStrided(x, begin, std::min(n, begin + kSumOfSquaresChunk), 1);
  });
  double total = 0.0;  // chunk order, whatever the thread count
  for (double chunk_sum : chunk_sums) total += chunk_sum;
  return total;
}

void ScaleCpu(float* x, size_t n, float scale) {
  cpu::ParallelFor(static_cast<long>(n), [=](long i) { x[i] *= scale; });
}

}  // namespace muster::kernels
