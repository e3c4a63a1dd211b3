// Device helpers of the fused CUDA kernels (kernels/fast/*.cu); not part of
// the API. Activations are stored as `float` (fp32, tf32) or
// __nv_bfloat16 (bf16); every kernel is a template over that storage type
// and does its arithmetic in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/fast/fast.h"
#ifdef MUSTER_SIMT
// Built for the CPU emulation (kernels/simt/simt.h): the kernels' inline
// PTX and launches take the #ifdef MUSTER_SIMT branches.
#include "kernels/simt/simt.h"
#endif

namespace muster::kernels::fast {

using bf16 = __nv_bfloat16;

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float ToFloat<bf16>(bf16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 FromFloat<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of T, loaded and stored with one 128-bit access. REQUIRES: the
// address is 16-byte aligned (every row of a tensor whose width is a
// multiple of kPackFloats... see CheckShape in fast.h).
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Pack<T> LoadPack(const T* address) {
  return *reinterpret_cast<const Pack<T>*>(address);
}
template <typename T>
__device__ __forceinline__ void StorePack(T* address, const Pack<T>& pack) {
  *reinterpret_cast<Pack<T>*>(address) = pack;
}

// A pack held as 4 registers: kernels that keep several packs a thread
// hold them as uint4 and view them as Pack<T> where they compute (as
// Pack<bf16> the compiler gave each element a register of its own).
template <typename T>
__device__ __forceinline__ Pack<T> AsPack(const uint4& bits) {
  Pack<T> pack;
  memcpy(&pack, &bits, sizeof(pack));
  return pack;
}
template <typename T>
__device__ __forceinline__ uint4 AsBits(const Pack<T>& pack) {
  uint4 bits;
  memcpy(&bits, &pack, sizeof(bits));
  return bits;
}

// Sum (or max) over the 32 lanes of a warp. The xor butterfly gives every
// lane the same bits: each level adds the same two values, in either
// order, and addition is commutative.
__device__ __forceinline__ float WarpSum(float x) {
  for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int mask = 16; mask > 0; mask >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x as the one instruction the hardware has for it (MUFU.EX2, through
// ex2.approx.ftz; relative error about 2^-22). exp2f and expf, without
// nvcc's --use_fast_math, wrap it: exp2f in a range test and two
// multiplies for results below 2^-126, expf in a few more instructions
// for its argument's reduction. Results below 2^-126 become 0 here (the
// emulation flushes them too): callers use it where each term sits
// beside a sum of at least 1. e^x is Exp2(x * kLog2e), one FFMA away
// when x comes with an offset: Exp2(fmaf(x, kLog2e, -offset * kLog2e)).
__device__ __forceinline__ float Exp2(float x) {
#ifdef MUSTER_SIMT
  const float y = exp2f(x);
  return y < FLT_MIN ? 0.0f : y;
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

// cp.async.cg.shared.global of 16 bytes from global `src` to shared `dst`
// (both 16-byte aligned): the copy lands in the background, and the thread
// that issued it sees it after its CpAsyncCommitAndWaitAll (other threads
// after a barrier too). On the emulation, simt's, which leaves the
// destination NaN until then.
__device__ __forceinline__ void CpAsync16(void* dst, const void* src) {
#ifdef MUSTER_SIMT
  simt::CpAsync16(dst, src, 16);
#else
  const uint32_t destination = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(destination), "l"(src));
#endif
}
// Closes the calling thread's group of copies and waits for all of them.
__device__ __forceinline__ void CpAsyncCommitAndWaitAll() {
#ifdef MUSTER_SIMT
  simt::CpAsyncCommit();
  simt::CpAsyncWait(0);
#else
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// kKernel<<<grid, block, shared_bytes, stream>>>(args...); built with
// MUSTER_SIMT, the same kernel on the CPU emulation (kernels/simt).
template <auto kKernel, typename... Args>
void LaunchKernel(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args... args) {
#ifdef MUSTER_SIMT
  simt::Launch(grid, block, shared_bytes, [=] { kKernel(args...); });
#else
  // clang-format reads a .cuh as C++, and would split the >>>.
  // clang-format off
  kKernel<<<grid, block, shared_bytes, stream>>>(args...);
  // clang-format on
#endif
}

inline unsigned CeilDiv(size_t a, size_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// The error of the most recent launch, as the launchers' int status
// (with MUSTER_SIMT, simt.h's cudaGetLastError: the emulated launch's).
inline int LaunchStatus() { return static_cast<int>(cudaGetLastError()); }

// Calls fn.template operator()<T>() with T the storage type of `act`.
template <typename Fn>
int Dispatch(ActType act, Fn&& fn) {
  if (act == ActType::kBf16) return fn(bf16{});
  return fn(float{});
}

}  // namespace muster::kernels::fast
