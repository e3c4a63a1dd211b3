// Thin CUDA launchers over the row math in attention.h: one thread per
// (batch, head, position) row, the two backward passes as two kernels on
// one stream (so the second sees all of the first's writes). Simple rather
// than fast: a tuned version would use cublasSgemmStridedBatched on a
// head-major copy of qkv, as llm.c's CUDA trainer does.
#include "kernels/attention.h"
#include "kernels/cuda_launch.cuh"

namespace muster::kernels {
namespace {

struct RowIndex {
  int b, h, t;
};

__device__ RowIndex SplitRow(size_t row, int NH, int T) {
  return RowIndex{static_cast<int>(row / (static_cast<size_t>(NH) * T)),
                  static_cast<int>((row / T) % NH), static_cast<int>(row % T)};
}

__global__ void ForwardKernel(float* out, float* att, const float* qkv, int B, int T, int C,
                              int NH) {
  size_t row = cuda::GlobalThread();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const int hs = C / NH;
  RowIndex r = SplitRow(row, NH, T);
  AttentionRowForward(out + AttentionOutOffset(r.b, r.h, T, C, hs),
                      att + AttentionMapOffset(r.b, r.h, NH, T),
                      qkv + AttentionQkvOffset(r.b, r.h, T, C, hs), r.t, T, C, hs);
}

__global__ void BackwardScoresKernel(float* dpreatt, const float* dout, const float* qkv,
                                     const float* att, int B, int T, int C, int NH) {
  size_t row = cuda::GlobalThread();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const int hs = C / NH;
  RowIndex r = SplitRow(row, NH, T);
  const size_t map = AttentionMapOffset(r.b, r.h, NH, T);
  AttentionRowBackwardScores(dpreatt + map, att + map, qkv + AttentionQkvOffset(r.b, r.h, T, C, hs),
                             dout + AttentionOutOffset(r.b, r.h, T, C, hs), r.t, T, C, hs);
}

__global__ void BackwardInputsKernel(float* dqkv, const float* dpreatt, const float* dout,
                                     const float* qkv, const float* att, int B, int T, int C,
                                     int NH) {
  size_t row = cuda::GlobalThread();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const int hs = C / NH;
  RowIndex r = SplitRow(row, NH, T);
  const size_t map = AttentionMapOffset(r.b, r.h, NH, T);
  const size_t qkv_offset = AttentionQkvOffset(r.b, r.h, T, C, hs);
  AttentionRowBackwardInputs(dqkv + qkv_offset, dpreatt + map, att + map, qkv + qkv_offset,
                             dout + AttentionOutOffset(r.b, r.h, T, C, hs), r.t, T, C, hs);
}

}  // namespace

int AttentionForwardCuda(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                         void* stream) {
  const size_t rows = static_cast<size_t>(B) * NH * T;
  if (rows == 0) return 0;
  ForwardKernel<<<cuda::Blocks(rows), cuda::kBlock, 0, cuda::AsStream(stream)>>>(out, att, qkv, B,
                                                                                 T, C, NH);
  return cuda::LaunchStatus();
}

int AttentionBackwardCuda(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH, void* stream) {
  const size_t rows = static_cast<size_t>(B) * NH * T;
  if (rows == 0) return 0;
  BackwardScoresKernel<<<cuda::Blocks(rows), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      dpreatt, dout, qkv, att, B, T, C, NH);
  int status = cuda::LaunchStatus();
  if (status != 0) return status;
  BackwardInputsKernel<<<cuda::Blocks(rows), cuda::kBlock, 0, cuda::AsStream(stream)>>>(
      dqkv, dpreatt, dout, qkv, att, B, T, C, NH);
  return cuda::LaunchStatus();
}

}  // namespace muster::kernels
