// One warp per row; each lane takes 16-byte packs of the row, lane l the
// packs l, l + 32, ... Rows of at most kMaxRowPacks packs a lane (GPT-2's
// 768 channels in bf16; see RowPacks) load each of a lane's packs once, all
// of them before using any, and keep them in registers for the later
// passes; wider rows read the row again for each pass (from L1 or L2).
// Both add in the same order, so they give the same bits. Every channel
// of a row belongs to one lane, in every row, so the backward's running
// parameter gradients live in that lane's registers where they fit
// (kRegisterSums), in shared memory where they do not: again the same sums
// in the same order.
#include <type_traits>

#include "kernels/fast/common.cuh"
#include "kernels/fast/gemm.h"
#include "kernels/fast/layernorm.h"
#include "kernels/layernorm.h"

namespace muster::kernels::fast {
namespace {

constexpr int kForwardRowsPerBlock = 8;

// A lane holds at most this many packs of a row in registers (as uint4,
// 4 registers each): 1024 channels in bf16, 512 in fp32. fp32's 6 packs
// for GPT-2's 768 would take the backward to 144 registers and one block
// an SM, so fp32 rows that wide keep the loop kernels.
constexpr int kMaxRowPacks = 4;

// The packs a lane holds for rows of C channels: the least of 1, 2, 3 and 4
// that covers C (GPT-2's 768 in bf16: 3); 0 where more are needed (the
// loop kernels).
template <typename T>
int RowPacks(int C) {
  const int needed = CeilDiv(C, 32 * Pack<T>::kSize);
  return needed <= kMaxRowPacks ? needed : 0;
}

// Runs f(std::integral_constant<int, packs>) for RowPacks's value.
template <typename T, typename F>
int WithRowPacks(int C, F f) {
  switch (RowPacks<T>(C)) {
    case 1:
      return f(std::integral_constant<int, 1>());
    case 2:
      return f(std::integral_constant<int, 2>());
    case 3:
      return f(std::integral_constant<int, 3>());
    case 4:
      return f(std::integral_constant<int, 4>());
    default:
      return f(std::integral_constant<int, 0>());
  }
}

// Whether the backward keeps a lane's running dweight and dbias in
// registers: 2 x 8 floats a pack for bf16, beside the 3 x 4 registers a
// pack of its held rows. Up to 3 packs (GPT-2's 768 in bf16: 48 + 36)
// that stays within the launch bound's 128 registers (sm_90a: 128, no
// spills); 4 would not.
template <int kPacks>
constexpr bool kRegisterSums = kPacks > 0 && kPacks <= 3;

// Calls f(k, c) for this lane's packs of a row of C channels, in order:
// the k-th at channel c = (lane + 32 k) P, for each c < C; with kPacks > 0
// (the row kernels) k < kPacks too, unrolled.
template <int P, int kPacks, typename F>
__device__ __forceinline__ void ForEachRowPack(int lane, int C, F f) {
  if constexpr (kPacks > 0) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int c = (lane + 32 * k) * P;
      if (c < C) f(k, c);
    }
  } else {
    for (int k = 0, c = lane * P; c < C; ++k, c += 32 * P) f(k, c);
  }
}

// The row kernels' first step: this lane's packs of each of the first
// kCount tensors of `from` into held[j][k], every load issued before any
// is used.
template <typename T, int kCount, int kPacks>
__device__ __forceinline__ void LoadRowPacks(uint4 (&held)[kCount][kPacks], const T* const* from,
                                             size_t base, int lane, int C) {
  ForEachRowPack<Pack<T>::kSize, kPacks>(lane, C, [&](int k, int c) {
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      held[j][k] = *reinterpret_cast<const uint4*>(from[j] + base + c);
    }
  });
}

// With kPacks > 0 (RowPacks) each lane loads its packs of the inputs at
// once, before using any, and keeps the row (the residual sum) in
// registers for the later passes; with 0 it reads the row again for each
// pass. The same arithmetic in the same order either way.
template <typename T, bool kResidual, int kPacks>
__global__ void ForwardKernel(T* out, float* mean_out, float* rstd_out, T* residual, const T* inp1,
                              const T* inp2, const float* weight, const float* bias, int N, int C) {
  constexpr int P = Pack<T>::kSize;
  constexpr int kHeld = kPacks > 0 ? kPacks : 1;  // held packs' array size
  const int row = blockIdx.x * kForwardRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t base = static_cast<size_t>(row) * C;
  const T* x = kResidual ? residual + base : inp1 + base;

  // [0]: inp1, then the residual; [1]: inp2.
  constexpr int kInputs = kResidual ? 2 : 1;
  uint4 held[kInputs][kHeld];
  const T* const inputs[2] = {inp1, inp2};
  if (kPacks > 0) LoadRowPacks<T>(held, inputs, base, lane, C);
  // This lane's k-th pack of the row (after the first pass: the residual).
  auto row_pack = [&](int k, int c) {
    return kPacks > 0 ? AsPack<T>(held[0][k]) : LoadPack(x + c);
  };

  float sum = 0.0f;
  ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
    Pack<T> pack;
    if (kResidual) {
      const Pack<T> a = kPacks > 0 ? AsPack<T>(held[0][k]) : LoadPack(inp1 + base + c);
      // (held[kInputs - 1] is held[1] here; written so, it also compiles
      // where kResidual is false and held has one row.)
      const Pack<T> b = kPacks > 0 ? AsPack<T>(held[kInputs - 1][k]) : LoadPack(inp2 + base + c);
      for (int i = 0; i < P; ++i) pack.v[i] = FromFloat<T>(ToFloat(a.v[i]) + ToFloat(b.v[i]));
      StorePack(residual + base + c, pack);
      if (kPacks > 0) held[0][k] = AsBits(pack);
    } else {
      pack = row_pack(k, c);
    }
    for (int i = 0; i < P; ++i) sum += ToFloat(pack.v[i]);
  });
  const float mean = WarpSum(sum) / C;
  float squares = 0.0f;
  ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
    const Pack<T> pack = row_pack(k, c);
    for (int i = 0; i < P; ++i) {
      const float d = ToFloat(pack.v[i]) - mean;
      squares += d * d;
    }
  });
  const float rstd = rsqrtf(WarpSum(squares) / C + kLayerNormEps);
  ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
    const Pack<T> pack = row_pack(k, c);
    Pack<T> y;
    for (int i = 0; i < P; ++i) {
      y.v[i] = FromFloat<T>((ToFloat(pack.v[i]) - mean) * rstd * weight[c + i] + bias[c + i]);
    }
    StorePack(out + base + c, y);
  });
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Backward: block y takes rows [blockIdx.x * kBackwardRows, ...), each of
// its warps every kBackwardWarps-th row. A warp keeps its own running
// dweight and dbias, each lane those of its own channels: in its registers
// (kRegisterSums), or else in shared memory, read and written per row.
// Then the warps' sums are added in warp order, through shared memory,
// into this block's row of partials (blocks, 2C): [dweight | dbias].
// AddColumnSums finishes.
// In shared memory element i of channel pack p sits at i * (C / P) + p, so
// the 32 lanes, which hold 32 neighbouring packs, hit 32 different banks.
// 8 warps of 4 rows: at GPT-2's 8192 rows that is 256 blocks, enough to
// fill the GPU (64-row blocks of 4 warps left it half idle).
constexpr int kBackwardWarps = 8;
constexpr int kBackwardRows = 32;

// With kPacks > 0 (RowPacks), a warp loads each row's dout, inp and dinp
// packs at once, before using any, and keeps them in registers for the
// second pass; with 0 it reads the row again there. The same arithmetic in
// the same order either way.
template <typename T, int kPacks>
__global__ void __launch_bounds__(32 * kBackwardWarps, 2)  // two blocks an SM: 128 registers
    BackwardKernel(T* dinp, float* partials, const T* dout, const T* inp, const float* weight,
                   const float* mean, const float* rstd, int N, int C) {
  constexpr int P = Pack<T>::kSize;
  constexpr int kHeld = kPacks > 0 ? kPacks : 1;               // held packs' array size
  constexpr int kSummed = kRegisterSums<kPacks> ? kPacks : 1;  // register sums' array size
#ifdef MUSTER_SIMT
  float* shared = reinterpret_cast<float*>(simt::DynamicShared());
#else
  extern __shared__ float shared[];  // (kBackwardWarps, 2C)
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* dweight_acc = shared + static_cast<size_t>(warp) * 2 * C;
  float* dbias_acc = dweight_acc + C;
  // This lane's running sums for its pack k, element i (kRegisterSums).
  float dweight_sum[kSummed][P], dbias_sum[kSummed][P];
  if constexpr (kRegisterSums<kPacks>) {
#pragma unroll
    for (int k = 0; k < kSummed; ++k) {
#pragma unroll
      for (int i = 0; i < P; ++i) dweight_sum[k][i] = dbias_sum[k][i] = 0.0f;
    }
  } else {
    for (int c = lane; c < 2 * C; c += 32) dweight_acc[c] = 0.0f;
    __syncwarp();
  }

  const int row_end = min((blockIdx.x + 1) * kBackwardRows, N);
  for (int row = blockIdx.x * kBackwardRows + warp; row < row_end; row += kBackwardWarps) {
    const size_t base = static_cast<size_t>(row) * C;
    const float row_mean = mean[row], row_rstd = rstd[row];
    uint4 held[3][kHeld];  // dout, inp, dinp
    const T* const tensors[3] = {dout, inp, dinp};
    if (kPacks > 0) LoadRowPacks<T>(held, tensors, base, lane, C);
    // Pack k of this lane's part of the row: c = (lane + 32 k) P.
    auto packs_of = [&](int k, int c, Pack<T>* g, Pack<T>* x) {
      if (kPacks > 0) {
        *g = AsPack<T>(held[0][k]);
        *x = AsPack<T>(held[1][k]);
      } else {
        *g = LoadPack(dout + base + c);
        *x = LoadPack(inp + base + c);
      }
    };
    float dnorm_sum = 0.0f, dnorm_xhat_sum = 0.0f;
    ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
      Pack<T> g, x;
      packs_of(k, c, &g, &x);
      for (int i = 0; i < P; ++i) {
        const float xhat = (ToFloat(x.v[i]) - row_mean) * row_rstd;
        const float dy = ToFloat(g.v[i]);
        const float dnorm = dy * weight[c + i];
        dnorm_sum += dnorm;
        dnorm_xhat_sum += dnorm * xhat;
        if constexpr (kRegisterSums<kPacks>) {
          dweight_sum[k][i] += dy * xhat;
          dbias_sum[k][i] += dy;
        } else {
          const int slot = i * (C / P) + c / P;
          dweight_acc[slot] += dy * xhat;
          dbias_acc[slot] += dy;
        }
      }
    });
    const float dnorm_mean = WarpSum(dnorm_sum) / C;
    const float dnorm_xhat_mean = WarpSum(dnorm_xhat_sum) / C;
    ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
      Pack<T> g, x;
      packs_of(k, c, &g, &x);
      Pack<T> d = kPacks > 0 ? AsPack<T>(held[2][k]) : LoadPack(dinp + base + c);
      for (int i = 0; i < P; ++i) {
        const float xhat = (ToFloat(x.v[i]) - row_mean) * row_rstd;
        const float dnorm = ToFloat(g.v[i]) * weight[c + i];
        const float grad = (dnorm - dnorm_mean - xhat * dnorm_xhat_mean) * row_rstd;
        d.v[i] = FromFloat<T>(ToFloat(d.v[i]) + grad);
      }
      StorePack(dinp + base + c, d);
    });
  }
  if constexpr (kRegisterSums<kPacks>) {
    // Into the slots the shared-memory sums use: every channel of the row
    // is one lane's, so every slot of this warp's is written.
    ForEachRowPack<P, kPacks>(lane, C, [&](int k, int c) {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const int slot = i * (C / P) + c / P;
        dweight_acc[slot] = dweight_sum[k][i];
        dbias_acc[slot] = dbias_sum[k][i];
      }
    });
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
    return WithRowPacks<T>(C, [&](auto packs) {
      constexpr int kPacks = decltype(packs)::value;
      if (inp2 != nullptr) {
        LaunchKernel<ForwardKernel<T, true, kPacks>>(
            blocks, threads, 0, AsStream(stream), static_cast<T*>(out), mean, rstd,
            static_cast<T*>(residual), static_cast<const T*>(inp1), static_cast<const T*>(inp2),
            weight, bias, N, C);
      } else {
        LaunchKernel<ForwardKernel<T, false, kPacks>>(
            blocks, threads, 0, AsStream(stream), static_cast<T*>(out), mean, rstd, nullptr,
            static_cast<const T*>(inp1), nullptr, weight, bias, N, C);
      }
      return LaunchStatus();
    });
  });
}

size_t LayerNormBackwardScratchFloats(int N, int C) {
  return static_cast<size_t>(CeilDiv(N, kBackwardRows)) * 2 * C;
}

int LayerNormBackward(ActType act, void* dinp, float* dweight, float* dbias, GradWrite write,
                      const void* dout, const void* inp, const float* weight, const float* mean,
                      const float* rstd, int N, int C, float* scratch, void* stream,
                      ColumnSumsBatch* defer) {
  if (N == 0) return 0;
  const unsigned blocks = CeilDiv(N, kBackwardRows);
  const size_t shared_bytes = static_cast<size_t>(kBackwardWarps) * 2 * C * sizeof(float);
  int status = Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
    return WithRowPacks<T>(C, [&](auto packs) {
      constexpr auto kernel = BackwardKernel<T, decltype(packs)::value>;
#ifndef MUSTER_SIMT
      if (shared_bytes > 48 * 1024) {
        const cudaError_t error = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
        if (error != cudaSuccess) return static_cast<int>(error);
      }
#endif
      LaunchKernel<kernel>(blocks, 32 * kBackwardWarps, shared_bytes, AsStream(stream),
                           static_cast<T*>(dinp), scratch, static_cast<const T*>(dout),
                           static_cast<const T*>(inp), weight, mean, rstd, N, C);
      return LaunchStatus();
    });
  });
  if (status != 0) return status;
  // partials (blocks, 2C): [dweight | dbias], both sums in one job.
  const int rows = static_cast<int>(blocks);
  const ColumnSumsJob job{dweight, dbias, C, scratch, rows, 2 * C, 2 * C, write};
  return defer != nullptr ? defer->Add(job, stream) : AddColumnSums(&job, 1, stream);
}

}  // namespace muster::kernels::fast
