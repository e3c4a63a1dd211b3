// One block per row. Each thread keeps an online (max, sum of exp) over
// its packs; the pairs are merged in a fixed tree, so the row's
// log-sum-exp has the same bits every run.
#include <cmath>

#include "kernels/fast/classifier.h"
#include "kernels/fast/common.cuh"

namespace muster::kernels::fast {
namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max;
  float sum;  // of exp(x - max)
};

__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float max = fmaxf(a.max, b.max);
  return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

template <typename T>
__global__ void ClassifierKernel(float* losses, T* logits, const int* targets, float dloss,
                                 bool write_grad, int V, int Vp) {
  constexpr int P = Pack<T>::kSize;
  __shared__ MaxSum warp_results[kThreads / 32];
  __shared__ float target_logit;
  const size_t row = blockIdx.x;
  T* x = logits + row * Vp;
  const int target = targets[row];
  if (threadIdx.x == 0) target_logit = ToFloat(x[target]);

  MaxSum mine{-INFINITY, 0.0f};
  for (int c = threadIdx.x * P; c < V; c += kThreads * P) {
    const Pack<T> pack = LoadPack(x + c);
    for (int i = 0; i < P && c + i < V; ++i) {
      // One exp per element: rescale the running sum only on a new max
      // (from -inf, the old sum is 0 and exp(-inf) is 0).
      const float value = ToFloat(pack.v[i]);
      if (value > mine.max) {
        mine.sum = mine.sum * expf(mine.max - value) + 1.0f;
        mine.max = value;
      } else {
        mine.sum += expf(value - mine.max);
      }
    }
  }
  for (int mask = 16; mask > 0; mask >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, mine.max, mask),
                       __shfl_xor_sync(0xffffffffu, mine.sum, mask)};
    mine = Merge(mine, other);
  }
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = mine;
  __syncthreads();
  MaxSum total = warp_results[0];
  for (int w = 1; w < kThreads / 32; ++w) total = Merge(total, warp_results[w]);
  const float lse = total.max + logf(total.sum);
  if (threadIdx.x == 0) losses[row] = lse - target_logit;
  if (!write_grad) return;

  // Every thread has passed the barrier above, so target_logit was read
  // before any element is overwritten.
  for (int c = threadIdx.x * P; c < Vp; c += kThreads * P) {
    const Pack<T> pack = LoadPack(x + c);
    Pack<T> grad;
    for (int i = 0; i < P; ++i) {
      const int v = c + i;
      float g = 0.0f;
      if (v < V) g = (expf(ToFloat(pack.v[i]) - lse) - (v == target ? 1.0f : 0.0f)) * dloss;
      grad.v[i] = FromFloat<T>(g);
    }
    StorePack(x + c, grad);
  }
}

}  // namespace

int ClassifierForward(ActType act, float* losses, void* logits, const int* targets, float dloss,
                      bool write_grad, int BT, int V, int Vp, void* stream) {
  if (BT == 0) return 0;
  return Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
    LaunchKernel<ClassifierKernel<T>>(BT, kThreads, 0, AsStream(stream), losses,
                                      static_cast<T*>(logits), targets, dloss, write_grad, V, Vp);
    return LaunchStatus();
  });
}

}  // namespace muster::kernels::fast
