#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/fast/adamw.h"
#include "kernels/fast/common.cuh"

namespace muster::kernels::fast {
namespace {

constexpr int kThreads = 256;

// hyper is passed by value: kernel arguments live in constant memory.
// Each thread updates kWidth neighbours; the arrays are read and written
// with 128-bit accesses when they are 16-byte aligned (the stage buffers'
// tensors are), else one element at a time.
constexpr int kWidth = 4;

// Block i: chunk i. With kVector, every chunk starts on a multiple of 4
// floats and the buffers on 16 bytes (the caller checked).
template <bool kVector>
__global__ void AdamWChunksKernel(float* params, float* m, float* v, const float* grads, bf16* copy,
                                  const AdamWChunk* chunks, AdamWHyper hyper,
                                  float bias_correction1, float bias_correction2) {
  const AdamWChunk chunk = chunks[blockIdx.x];
  if (!chunk.decay) hyper.weight_decay = 0.0f;
  const size_t begin = chunk.begin, end = chunk.begin + chunk.count;
  for (size_t first = begin + threadIdx.x * kWidth; first < end; first += blockDim.x * kWidth) {
    if (kVector && first + kWidth <= end) {
      float4 p = *reinterpret_cast<float4*>(params + first);
      float4 mm = *reinterpret_cast<float4*>(m + first);
      float4 vv = *reinterpret_cast<float4*>(v + first);
      const float4 g = *reinterpret_cast<const float4*>(grads + first);
      AdamWElem(&p.x, &mm.x, &vv.x, g.x, hyper, bias_correction1, bias_correction2);
      AdamWElem(&p.y, &mm.y, &vv.y, g.y, hyper, bias_correction1, bias_correction2);
      AdamWElem(&p.z, &mm.z, &vv.z, g.z, hyper, bias_correction1, bias_correction2);
      AdamWElem(&p.w, &mm.w, &vv.w, g.w, hyper, bias_correction1, bias_correction2);
      *reinterpret_cast<float4*>(params + first) = p;
      *reinterpret_cast<float4*>(m + first) = mm;
      *reinterpret_cast<float4*>(v + first) = vv;
      if (copy != nullptr) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(p.z, p.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(copy + first) = packed;
      }
      continue;
    }
    for (size_t i = first; i < end && i < first + kWidth; ++i) {
      AdamWElem(params + i, m + i, v + i, grads[i], hyper, bias_correction1, bias_correction2);
      if (copy != nullptr) copy[i] = __float2bfloat16_rn(params[i]);
    }
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

__global__ void CastKernel(bf16* out, const float* in, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void WidenKernel(float* out, const uint16_t* in, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = FloatFromBf16(in[i]);
}

}  // namespace

int AdamWUpdateChunks(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                      const AdamWChunk* chunks, int num_chunks, bool aligned,
                      const AdamWHyper& hyper, int step, void* stream) {
  if (num_chunks == 0) return 0;
  const bool vector = aligned && Aligned(params, 16) && Aligned(m, 16) && Aligned(v, 16) &&
                      Aligned(grads, 16) && Aligned(params_bf16, 8);
  auto* copy = reinterpret_cast<bf16*>(params_bf16);
  const float correction1 = AdamWBiasCorrection(hyper.beta1, step);
  const float correction2 = AdamWBiasCorrection(hyper.beta2, step);
  if (vector) {
    LaunchKernel<AdamWChunksKernel<true>>(num_chunks, kThreads, 0, AsStream(stream), params, m, v,
                                          grads, copy, chunks, hyper, correction1, correction2);
  } else {
    LaunchKernel<AdamWChunksKernel<false>>(num_chunks, kThreads, 0, AsStream(stream), params, m, v,
                                           grads, copy, chunks, hyper, correction1, correction2);
  }
  return LaunchStatus();
}

int CastToBf16(uint16_t* out, const float* in, size_t n, void* stream) {
  if (n == 0) return 0;
  LaunchKernel<CastKernel>(CeilDiv(n, kThreads), kThreads, 0, AsStream(stream),
                           reinterpret_cast<bf16*>(out), in, n);
  return LaunchStatus();
}

int CastFromBf16(float* out, const uint16_t* in, size_t n, void* stream) {
  if (n == 0) return 0;
  LaunchKernel<WidenKernel>(CeilDiv(n, kThreads), kThreads, 0, AsStream(stream), out, in, n);
  return LaunchStatus();
}

}  // namespace muster::kernels::fast
