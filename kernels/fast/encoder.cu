#include "kernels/fast/common.cuh"
#include "kernels/fast/encoder.h"

namespace muster::kernels::fast {
namespace {

constexpr int kThreads = 128;

// Thread: one pack of channels of one row.
template <typename T>
__global__ void ForwardKernel(T* out, const int* tokens, const float* wte, const float* wpe, int BT,
                              int T_, int C) {
  constexpr int P = Pack<T>::kSize;
  const size_t index = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) * P;
  if (index >= static_cast<size_t>(BT) * C) return;
  const int row = static_cast<int>(index / C), c = static_cast<int>(index % C);
  const float* token_row = wte + static_cast<size_t>(tokens[row]) * C + c;
  const float* position_row = wpe + static_cast<size_t>(row % T_) * C + c;
  Pack<T> pack;
  for (int i = 0; i < P; ++i) pack.v[i] = FromFloat<T>(token_row[i] + position_row[i]);
  StorePack(out + index, pack);
}

// Block (g, y): token group g, channel packs y * kThreads + thread.
template <typename T>
__global__ void TokenBackwardKernel(float* dwte, const T* dout, const int* group_tokens,
                                    const int* group_starts, const int* positions, int C) {
  constexpr int P = Pack<T>::kSize;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * P;
  if (c >= C) return;
  const int g = blockIdx.x;
  float acc[P];
  for (int i = 0; i < P; ++i) acc[i] = 0.0f;
  for (int j = group_starts[g]; j < group_starts[g + 1]; ++j) {
    const Pack<T> pack = LoadPack(dout + static_cast<size_t>(positions[j]) * C + c);
    for (int i = 0; i < P; ++i) acc[i] += ToFloat(pack.v[i]);
  }
  float* row = dwte + static_cast<size_t>(group_tokens[g]) * C + c;
  for (int i = 0; i < P; ++i) row[i] += acc[i];
}

// Block (t, y): position t, channel packs as above; sums over b in order.
template <typename T>
__global__ void PositionBackwardKernel(float* dwpe, GradWrite write, const T* dout, int B, int T_,
                                       int C) {
  constexpr int P = Pack<T>::kSize;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * P;
  if (c >= C) return;
  const int t = blockIdx.x;
  float acc[P];
  for (int i = 0; i < P; ++i) acc[i] = 0.0f;
  for (int b = 0; b < B; ++b) {
    const Pack<T> pack = LoadPack(dout + (static_cast<size_t>(b) * T_ + t) * C + c);
    for (int i = 0; i < P; ++i) acc[i] += ToFloat(pack.v[i]);
  }
  float* row = dwpe + static_cast<size_t>(t) * C + c;
  for (int i = 0; i < P; ++i) row[i] = write == GradWrite::kOverwrite ? acc[i] : row[i] + acc[i];
}

}  // namespace

int EncoderForward(ActType act, void* out, const int* tokens, const float* wte, const float* wpe,
                   int B, int T, int C, void* stream) {
  const size_t elements = static_cast<size_t>(B) * T * C;
  if (elements == 0) return 0;
  return Dispatch(act, [&](auto tag) {
    using Tp = decltype(tag);
    const size_t threads = elements / Pack<Tp>::kSize;
    LaunchKernel<ForwardKernel<Tp>>(CeilDiv(threads, kThreads), kThreads, 0, AsStream(stream),
                                    static_cast<Tp*>(out), tokens, wte, wpe, B * T, T, C);
    return LaunchStatus();
  });
}

int EncoderBackward(ActType act, float* dwte, float* dwpe, GradWrite wpe_write, const void* dout,
                    const int* group_tokens, const int* group_starts, const int* positions,
                    int groups, int B, int T, int C, void* stream) {
  if (B == 0 || T == 0) return 0;
  return Dispatch(act, [&](auto tag) {
    using Tp = decltype(tag);
    const unsigned channel_blocks = CeilDiv(C / Pack<Tp>::kSize, kThreads);
    LaunchKernel<TokenBackwardKernel<Tp>>(dim3(groups, channel_blocks), kThreads, 0,
                                          AsStream(stream), dwte, static_cast<const Tp*>(dout),
                                          group_tokens, group_starts, positions, C);
    int status = LaunchStatus();
    if (status != 0) return status;
    LaunchKernel<PositionBackwardKernel<Tp>>(dim3(T, channel_blocks), kThreads, 0, AsStream(stream),
                                             dwpe, wpe_write, static_cast<const Tp*>(dout), B, T,
                                             C);
    return LaunchStatus();
  });
}

}  // namespace muster::kernels::fast
