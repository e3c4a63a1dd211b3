// One block per row. Each thread keeps an online (max, sum of exp) over
// its packs; the pairs are merged in a fixed tree, so the row's
// log-sum-exp has the same bits every run. Every exponential is one FFMA
// and one MUFU.EX2 (Exp2, common.cuh): the kernel streams B*T*V
// elements, and expf's longer sequence, twice an element, made it as busy
// issuing instructions as moving bytes.
//
// Three kernels, chosen by the row's width and type (ClassifierForward):
// - ClassifierKernel<T, true>, staged, copies the row into shared memory
//   (cp.async) and reads it there for both passes, so each logit is read
//   from memory once and written once, and no row is held in registers.
//   It runs where two such blocks fit in an SM's shared memory (rows up
//   to about 110 KB on an H100 or H200: GPT-2's 50,304 logits in bf16, 98
//   KB), so that one block's loads are in flight while the other computes
//   its exponentials (two per logit, at 16 a clock an SM) and its
//   block-wide reduction. A block that holds its row in registers fills
//   the register file alone, and its SM idles its memory between those
//   phases: on an H200 that kernel took 0.588 ms a step, where the bytes
//   alone need 0.34.
// - ClassifierRowKernel keeps the row in registers, up to kRowPacks packs
//   a thread in blocks of 1024 (65,536 bf16 values or 32,768 fp32), so
//   each logit is read once and written once: for rows of that size that
//   the staged kernel cannot take. (The profile put the two-read kernel
//   at 0.83 ms of an H100 step, three passes over 0.82 GB of bf16 logits
//   at ≈ 3 TB/s.)
// - ClassifierKernel<T, false> reads the row twice (the sums, then the
//   gradient), for rows wider than that, and for narrow ones (a pack or
//   less a thread), where 1024 threads would mostly idle.
// Each gives the same bits every run. The staged kernel gives the
// two-read kernel's bits (the same threads take the same packs, and add
// in the same order); the row kernel sums in another order, so its bits
// differ, and the width, the type and the GPU's shared memory alone decide
// which runs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

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

// This block's row of logits, its target, and (thread 0, into shared
// memory) the target's logit, read before anything is written.
template <typename T>
__device__ __forceinline__ T* StartRow(T* logits, int Vp, const int* targets, int* target,
                                       float* target_logit) {
  T* x = logits + static_cast<size_t>(blockIdx.x) * Vp;
  *target = targets[blockIdx.x];
  if (threadIdx.x == 0) *target_logit = ToFloat(x[*target]);
  return x;
}

// The row's log-sum-exp from each thread's (max, sum): a butterfly in
// each warp, then the warps in order. Every thread of the block calls it
// (it has a barrier) and gets the same value.
template <int kBlock>
__device__ __forceinline__ float RowLogSumExp(MaxSum mine, MaxSum* warp_results) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, mine.max, mask),
                       __shfl_xor_sync(0xffffffffu, mine.sum, mask)};
    mine = Merge(mine, other);
  }
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = mine;
  __syncthreads();
  MaxSum total = warp_results[0];
  for (int w = 1; w < kBlock / 32; ++w) total = Merge(total, warp_results[w]);
  return total.max + logf(total.sum);
}

// The target's element, written as p * dloss with the rest, becomes (p -
// 1) * dloss once every thread's stores are done: one write a row instead
// of a test an element.
template <typename T>
__device__ __forceinline__ void FixTarget(T* x, int target, float target_logit, float lse_log2,
                                          float dloss) {
  __syncthreads();
  if (threadIdx.x == 0) {
    x[target] = FromFloat<T>((Exp2(fmaf(target_logit, kLog2e, -lse_log2)) - 1.0f) * dloss);
  }
}

constexpr int kRowThreads = 1024;
constexpr int kRowPacks = 8;  // 8 x 16 bytes a thread: 32 registers

template <typename T>
constexpr int RowCapacity() {
  return kRowThreads * kRowPacks * Pack<T>::kSize;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads, 1)
    ClassifierRowKernel(float* losses, T* logits, const int* targets, float dloss, bool write_grad,
                        int V, int Vp) {
  constexpr int P = Pack<T>::kSize;
  __shared__ MaxSum warp_results[kRowThreads / 32];
  __shared__ float target_logit;
  int target;
  T* x = StartRow(logits, Vp, targets, &target, &target_logit);

  // Pack i of this thread is columns [c, c + P), c = (i * kRowThreads +
  // threadIdx.x) * P: every load issued before any is used.
  // Held as 128-bit words: a Pack<bf16> held as such takes a register an
  // element (16 bits each), twice the registers, and spilled.
  uint4 packs[kRowPacks];
#pragma unroll
  for (int i = 0; i < kRowPacks; ++i) {
    const int c = (i * kRowThreads + threadIdx.x) * P;
    if (c < V) packs[i] = *reinterpret_cast<const uint4*>(x + c);
  }
  MaxSum mine{-INFINITY, 0.0f};
#pragma unroll
  for (int i = 0; i < kRowPacks; ++i) {
    const int c = (i * kRowThreads + threadIdx.x) * P;
    if (c + P <= V) {
      AddPack(mine, AsPack<T>(packs[i]), P);
    } else if (c < V) {
      AddPack(mine, AsPack<T>(packs[i]), V - c);
    }
  }
  const float lse = RowLogSumExp<kRowThreads>(mine, warp_results);
  if (threadIdx.x == 0) losses[blockIdx.x] = lse - target_logit;
  if (!write_grad) return;

  // dlogits = (softmax - onehot(target)) * dloss, 0 past V (a pack at or
  // past V was not loaded: GradPack writes its n <= 0 elements as zeros).
  // target_logit was read before the barrier in RowLogSumExp.
  const float lse_log2 = lse * kLog2e;
#pragma unroll
  for (int i = 0; i < kRowPacks; ++i) {
    const int c = (i * kRowThreads + threadIdx.x) * P;
    if (c < Vp) {
      const Pack<T> pack = AsPack<T>(packs[i]);
      StorePack(x + c, c + P <= V ? GradPack(pack, P, lse_log2, dloss)
                                  : GradPack(pack, V - c, lse_log2, dloss));
    }
  }
  FixTarget(x, target, target_logit, lse_log2, dloss);
}

// With kStaged the block first copies the row into shared memory (`Vp`
// values of T, dynamic), and both passes read it there: the same packs per
// thread in the same order, so the same bits. Each thread reads back only
// the packs it copied itself, which its own wait makes visible to it, so
// the copy needs no barrier.
template <typename T, bool kStaged>
__global__ void __launch_bounds__(kThreads, kStaged ? 2 : 1)
    ClassifierKernel(float* losses, T* logits, const int* targets, float dloss, bool write_grad,
                     int V, int Vp) {
  constexpr int P = Pack<T>::kSize;
  __shared__ MaxSum warp_results[kThreads / 32];
  __shared__ float target_logit;
  int target;
  T* x = StartRow(logits, Vp, targets, &target, &target_logit);
  const T* from = x;  // where the passes read the row
  if constexpr (kStaged) {
#ifdef MUSTER_SIMT
    T* const row = reinterpret_cast<T*>(simt::DynamicShared());
#else
    extern __shared__ __align__(16) unsigned char staged[];
    T* const row = reinterpret_cast<T*>(staged);
#endif
    for (int c = threadIdx.x * P; c < Vp; c += kThreads * P) CpAsync16(row + c, x + c);
    CpAsyncCommitAndWaitAll();
    from = row;
  }

  // Full packs and the one that passes V take separate paths, so a full
  // pack's loops carry no bounds.
  MaxSum mine{-INFINITY, 0.0f};
  for (int c = threadIdx.x * P; c < V; c += kThreads * P) {
    const Pack<T> pack = LoadPack(from + c);
    if (c + P <= V) {
      AddPack(mine, pack, P);
    } else {
      AddPack(mine, pack, V - c);
    }
  }
  const float lse = RowLogSumExp<kThreads>(mine, warp_results);
  if (threadIdx.x == 0) losses[blockIdx.x] = lse - target_logit;
  if (!write_grad) return;

  // dlogits = (softmax - onehot(target)) * dloss, 0 past V. Every thread
  // has passed the barrier above, so target_logit was read before any
  // element is overwritten.
  const float lse_log2 = lse * kLog2e;
  for (int c = threadIdx.x * P; c < Vp; c += kThreads * P) {
    const Pack<T> pack = LoadPack(from + c);
    StorePack(x + c, c + P <= V ? GradPack(pack, P, lse_log2, dloss)
                                : GradPack(pack, V - c, lse_log2, dloss));
  }
  FixTarget(x, target, target_logit, lse_log2, dloss);
}

// Shared memory an SM has, and the most dynamic shared memory a staged
// block may ask for, on the current device; the staged kernels'
// attributes are set for it the first time (they stay set, so a launch
// captured into a CUDA graph finds them set by the eager one before). The
// emulation has an H100's.
struct SharedMemory {
  size_t per_sm = 228 * 1024;
  size_t dynamic_per_block = 227 * 1024 - 2 * 1024;  // the opt-in less static, rounded up
};
SharedMemory DeviceSharedMemory() {
#ifdef MUSTER_SIMT
  return SharedMemory{};
#else
  constexpr int kDevices = 64;
  static std::mutex mutex;
  static SharedMemory known[kDevices];
  static bool asked[kDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return {0, 0};
  std::lock_guard<std::mutex> lock(mutex);
  if (!asked[device]) {
    asked[device] = true;
    int per_sm = 0, per_block = 0;
    bool ok = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                     device) == cudaSuccess &&
              cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
                  cudaSuccess;
    // A block's static and dynamic shared memory together may not pass
    // the opt-in limit, so the dynamic limit each kernel may be given is
    // the opt-in less the larger static size of the two (setting the
    // opt-in itself is cudaErrorInvalidValue, which left the staged kernel
    // unused until a GPU's memcheck run showed it).
    const void* kernels[] = {reinterpret_cast<const void*>(&ClassifierKernel<float, true>),
                             reinterpret_cast<const void*>(&ClassifierKernel<bf16, true>)};
    size_t static_bytes = 0;
    for (const void* kernel : kernels) {
      cudaFuncAttributes attributes{};
      ok = ok && cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess;
      static_bytes = std::max(static_bytes, attributes.sharedSizeBytes);
    }
    ok = ok && static_bytes < static_cast<size_t>(per_block);
    const int dynamic = ok ? per_block - static_cast<int>(static_bytes) : 0;
    // Both types' kernels, allowed that much, and asked to run with the
    // most shared memory (two blocks an SM need it all).
    for (const void* kernel : kernels) {
      ok = ok &&
           cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic) ==
               cudaSuccess &&
           cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared) == cudaSuccess;
    }
    // A failure here leaves the staged kernel unused; it is not the
    // caller's error, so it is not left for the next launch's check.
    if (!ok) cudaGetLastError();
    known[device] = ok ? SharedMemory{static_cast<size_t>(per_sm), static_cast<size_t>(dynamic)}
                       : SharedMemory{0, 0};
  }
  return known[device];
#endif
}

// Whether two staged blocks of a row of `row_bytes` fit in an SM: the row,
// plus 2 KB a block for its static shared memory (144 bytes) and the 1 KB
// the GPU keeps per block.
bool StagedFits(size_t row_bytes) {
  constexpr size_t kPerBlockExtra = 2 * 1024;
  const SharedMemory shared = DeviceSharedMemory();
  return row_bytes <= shared.dynamic_per_block && 2 * (row_bytes + kPerBlockExtra) <= shared.per_sm;
}

template <typename T>
ClassifierPath PathFor(int Vp) {
  const size_t row_bytes = static_cast<size_t>(Vp) * sizeof(T);
  if (Vp > kThreads * Pack<T>::kSize && StagedFits(row_bytes)) return ClassifierPath::kStaged;
  if (Vp > kThreads * Pack<T>::kSize && Vp <= RowCapacity<T>()) return ClassifierPath::kRegisters;
  return ClassifierPath::kTwoReads;
}

}  // namespace

int ClassifierForward(ActType act, float* losses, void* logits, const int* targets, float dloss,
                      bool write_grad, int BT, int V, int Vp, void* stream) {
  if (BT == 0) return 0;
  return Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
    switch (PathFor<T>(Vp)) {
      case ClassifierPath::kStaged:
        LaunchKernel<ClassifierKernel<T, true>>(BT, kThreads, static_cast<size_t>(Vp) * sizeof(T),
                                                AsStream(stream), losses, static_cast<T*>(logits),
                                                targets, dloss, write_grad, V, Vp);
        break;
      case ClassifierPath::kRegisters:
        LaunchKernel<ClassifierRowKernel<T>>(BT, kRowThreads, 0, AsStream(stream), losses,
                                             static_cast<T*>(logits), targets, dloss, write_grad, V,
                                             Vp);
        break;
      case ClassifierPath::kTwoReads:
        LaunchKernel<ClassifierKernel<T, false>>(BT, kThreads, 0, AsStream(stream), losses,
                                                 static_cast<T*>(logits), targets, dloss,
                                                 write_grad, V, Vp);
        break;
    }
    return LaunchStatus();
  });
}

ClassifierPath ClassifierPathFor(ActType act, int Vp) {
  if (act == ActType::kBf16) return PathFor<bf16>(Vp);
  return PathFor<float>(Vp);
}

}  // namespace muster::kernels::fast
