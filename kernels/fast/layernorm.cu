// One warp per row; each lane takes 16-byte packs of the row. The forward
// reads the row three times (sum, squared deviations, normalise); after
// the first, the reads hit L1.
#include "kernels/fast/common.cuh"
#include "kernels/fast/gemm.h"
#include "kernels/fast/layernorm.h"
#include "kernels/layernorm.h"

namespace muster::kernels::fast {
namespace {

constexpr int kForwardRowsPerBlock = 8;

template <typename T, bool kResidual>
__global__ void ForwardKernel(T* out, float* mean_out, float* rstd_out, T* residual, const T* inp1,
                              const T* inp2, const float* weight, const float* bias, int N, int C) {
  constexpr int P = Pack<T>::kSize;
  const int row = blockIdx.x * kForwardRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t base = static_cast<size_t>(row) * C;
  const T* x = kResidual ? residual + base : inp1 + base;

  float sum = 0.0f;
  for (int c = lane * P; c < C; c += 32 * P) {
    Pack<T> pack;
    if (kResidual) {
      const Pack<T> a = LoadPack(inp1 + base + c), b = LoadPack(inp2 + base + c);
      for (int i = 0; i < P; ++i) pack.v[i] = FromFloat<T>(ToFloat(a.v[i]) + ToFloat(b.v[i]));
      StorePack(residual + base + c, pack);
    } else {
      pack = LoadPack(x + c);
    }
    for (int i = 0; i < P; ++i) sum += ToFloat(pack.v[i]);
  }
  const float mean = WarpSum(sum) / C;
  float squares = 0.0f;
  for (int c = lane * P; c < C; c += 32 * P) {
    const Pack<T> pack = LoadPack(x + c);
    for (int i = 0; i < P; ++i) {
      const float d = ToFloat(pack.v[i]) - mean;
      squares += d * d;
    }
  }
  const float rstd = rsqrtf(WarpSum(squares) / C + kLayerNormEps);
  for (int c = lane * P; c < C; c += 32 * P) {
    const Pack<T> pack = LoadPack(x + c);
    Pack<T> y;
    for (int i = 0; i < P; ++i) {
      y.v[i] = FromFloat<T>((ToFloat(pack.v[i]) - mean) * rstd * weight[c + i] + bias[c + i]);
    }
    StorePack(out + base + c, y);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Backward: block y takes rows [blockIdx.x * kBackwardRows, ...), each of
// its warps every kBackwardWarps-th row. A warp keeps its own running
// dweight and dbias in shared memory (its lanes own disjoint channels),
// then the warps' sums are added in warp order into this block's row of
// partials (blocks, 2C): [dweight | dbias]. AddColumnSums finishes.
// In shared memory element i of channel pack p sits at i * (C / P) + p, so
// the 32 lanes, which hold 32 neighbouring packs, hit 32 different banks.
// 8 warps of 4 rows: at GPT-2's 8192 rows that is 256 blocks, enough to
// fill the GPU (64-row blocks of 4 warps left it half idle).
constexpr int kBackwardWarps = 8;
constexpr int kBackwardRows = 32;

template <typename T>
__global__ void BackwardKernel(T* dinp, float* partials, const T* dout, const T* inp,
                               const float* weight, const float* mean, const float* rstd, int N,
                               int C) {
  constexpr int P = Pack<T>::kSize;
#ifdef MUSTER_SIMT
  float* shared = reinterpret_cast<float*>(simt::DynamicShared());
#else
  extern __shared__ float shared[];  // (kBackwardWarps, 2C)
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* dweight_acc = shared + static_cast<size_t>(warp) * 2 * C;
  float* dbias_acc = dweight_acc + C;
  for (int c = lane; c < 2 * C; c += 32) dweight_acc[c] = 0.0f;
  __syncwarp();

  const int row_end = min((blockIdx.x + 1) * kBackwardRows, N);
  for (int row = blockIdx.x * kBackwardRows + warp; row < row_end; row += kBackwardWarps) {
    const size_t base = static_cast<size_t>(row) * C;
    const float row_mean = mean[row], row_rstd = rstd[row];
    float dnorm_sum = 0.0f, dnorm_xhat_sum = 0.0f;
    for (int c = lane * P; c < C; c += 32 * P) {
      const Pack<T> g = LoadPack(dout + base + c), x = LoadPack(inp + base + c);
      for (int i = 0; i < P; ++i) {
        const float xhat = (ToFloat(x.v[i]) - row_mean) * row_rstd;
        const float dy = ToFloat(g.v[i]);
        const float dnorm = dy * weight[c + i];
        dnorm_sum += dnorm;
        dnorm_xhat_sum += dnorm * xhat;
        const int slot = i * (C / P) + c / P;
        dweight_acc[slot] += dy * xhat;
        dbias_acc[slot] += dy;
      }
    }
    const float dnorm_mean = WarpSum(dnorm_sum) / C;
    const float dnorm_xhat_mean = WarpSum(dnorm_xhat_sum) / C;
    for (int c = lane * P; c < C; c += 32 * P) {
      const Pack<T> g = LoadPack(dout + base + c), x = LoadPack(inp + base + c);
      Pack<T> d = LoadPack(dinp + base + c);
      for (int i = 0; i < P; ++i) {
        const float xhat = (ToFloat(x.v[i]) - row_mean) * row_rstd;
        const float dnorm = ToFloat(g.v[i]) * weight[c + i];
        const float grad = (dnorm - dnorm_mean - xhat * dnorm_xhat_mean) * row_rstd;
        d.v[i] = FromFloat<T>(ToFloat(d.v[i]) + grad);
      }
      StorePack(dinp + base + c, d);
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    const int part = c / C, channel = c % C;  // part 0: dweight, 1: dbias
    const int slot = part * C + (channel % P) * (C / P) + channel / P;
    float total = 0.0f;
    for (int w = 0; w < kBackwardWarps; ++w) {
      total += shared[static_cast<size_t>(w) * 2 * C + slot];
    }
    partials[static_cast<size_t>(blockIdx.x) * 2 * C + c] = total;
  }
}

}  // namespace

int LayerNormForward(ActType act, void* out, float* mean, float* rstd, void* residual,
                     const void* inp1, const void* inp2, const float* weight, const float* bias,
                     int N, int C, void* stream) {
  if (N == 0) return 0;
  return Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = CeilDiv(N, kForwardRowsPerBlock);
    const unsigned threads = 32 * kForwardRowsPerBlock;
    if (inp2 != nullptr) {
      LaunchKernel<ForwardKernel<T, true>>(blocks, threads, 0, AsStream(stream),
                                           static_cast<T*>(out), mean, rstd,
                                           static_cast<T*>(residual), static_cast<const T*>(inp1),
                                           static_cast<const T*>(inp2), weight, bias, N, C);
    } else {
      LaunchKernel<ForwardKernel<T, false>>(
          blocks, threads, 0, AsStream(stream), static_cast<T*>(out), mean, rstd, nullptr,
          static_cast<const T*>(inp1), nullptr, weight, bias, N, C);
    }
    return LaunchStatus();
  });
}

size_t LayerNormBackwardScratchFloats(int N, int C) {
  return static_cast<size_t>(CeilDiv(N, kBackwardRows)) * 2 * C;
}

int LayerNormBackward(ActType act, void* dinp, float* dweight, float* dbias, const void* dout,
                      const void* inp, const float* weight, const float* mean, const float* rstd,
                      int N, int C, float* scratch, void* stream, ColumnSumsBatch* defer) {
  if (N == 0) return 0;
  const unsigned blocks = CeilDiv(N, kBackwardRows);
  const size_t shared_bytes = static_cast<size_t>(kBackwardWarps) * 2 * C * sizeof(float);
  int status = Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
#ifndef MUSTER_SIMT
    if (shared_bytes > 48 * 1024) {
      const cudaError_t error =
          cudaFuncSetAttribute(BackwardKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes));
      if (error != cudaSuccess) return static_cast<int>(error);
    }
#endif
    LaunchKernel<BackwardKernel<T>>(blocks, 32 * kBackwardWarps, shared_bytes, AsStream(stream),
                                    static_cast<T*>(dinp), scratch, static_cast<const T*>(dout),
                                    static_cast<const T*>(inp), weight, mean, rstd, N, C);
    return LaunchStatus();
  });
  if (status != 0) return status;
  // partials (blocks, 2C): [dweight | dbias], both sums in one job.
  const ColumnSumsJob job{dweight, dbias, C, scratch, static_cast<int>(blocks), 2 * C, 2 * C};
  return defer != nullptr ? defer->Add(job, stream) : AddColumnSums(&job, 1, stream);
}

}  // namespace muster::kernels::fast
