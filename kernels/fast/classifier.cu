// One block per row. Each thread keeps an online (max, sum of exp) over
// its packs; the pairs are merged in a fixed tree, so the row's
// log-sum-exp has the same bits every run. Every exponential is one FFMA
// and one MUFU.EX2 (Exp2, common.cuh): the kernel streams B*T*V
// elements, and expf's longer sequence, twice an element, made it as busy
// issuing instructions as moving bytes.
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
  return {max, a.sum * Exp2((a.max - max) * kLog2e) + b.sum * Exp2((b.max - max) * kLog2e)};
}

// Adds a pack's first n elements (P, but in the row's last pack) to a
// thread's running (max, sum): one exp each, and a rescale of the sum only
// when the pack raises the max (from -inf, the old sum is 0 and exp(-inf)
// is 0).
template <typename T>
__device__ __forceinline__ void AddPack(MaxSum& mine, const Pack<T>& pack, int n) {
  float pack_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) {
    if (i < n) pack_max = fmaxf(pack_max, ToFloat(pack.v[i]));
  }
  if (pack_max > mine.max) {
    mine.sum *= Exp2((mine.max - pack_max) * kLog2e);
    mine.max = pack_max;
  }
  const float offset = mine.max * kLog2e;
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) {
    if (i < n) mine.sum += Exp2(fmaf(ToFloat(pack.v[i]), kLog2e, -offset));
  }
}

// Each of a pack's first n elements' probability times dloss (0 past V):
// the gradient of every element but the target's.
template <typename T>
__device__ __forceinline__ Pack<T> GradPack(const Pack<T>& pack, int n, float lse_log2,
                                            float dloss) {
  Pack<T> grad;
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) {
    const float p = i < n ? Exp2(fmaf(ToFloat(pack.v[i]), kLog2e, -lse_log2)) : 0.0f;
    grad.v[i] = FromFloat<T>(p * dloss);
  }
  return grad;
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

  // Full packs and the one that passes V take separate paths, so a full
  // pack's loops carry no bounds.
  MaxSum mine{-INFINITY, 0.0f};
  for (int c = threadIdx.x * P; c < V; c += kThreads * P) {
    const Pack<T> pack = LoadPack(x + c);
    if (c + P <= V) {
      AddPack(mine, pack, P);
    } else {
      AddPack(mine, pack, V - c);
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

  // dlogits = (softmax - onehot(target)) * dloss, 0 past V. Every thread
  // has passed the barrier above, so target_logit was read before any
  // element is overwritten.
  const float lse_log2 = lse * kLog2e;
  for (int c = threadIdx.x * P; c < Vp; c += kThreads * P) {
    const Pack<T> pack = LoadPack(x + c);
    StorePack(x + c, c + P <= V ? GradPack(pack, P, lse_log2, dloss)
                                : GradPack(pack, V - c, lse_log2, dloss));
  }
  // The target's element, p * dloss above, becomes (p - 1) * dloss once
  // that store is done: one write a row instead of a test an element.
  __syncthreads();
  if (threadIdx.x == 0) {
    x[target] = FromFloat<T>((Exp2(fmaf(target_logit, kLog2e, -lse_log2)) - 1.0f) * dloss);
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
