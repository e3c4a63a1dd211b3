// Causal attention through cuDNN's fused flash-attention engines: the
// alternative to flash_attention.h's own kernels, chosen by train.yaml's
// `attention: cudnn`. Same layout and contract as flash_attention.h:
// qkv (B, T, 3C) bf16, out (B, T, C) bf16, dqkv (B, T, 3C) bf16.
//
// How: cuDNN's graph API, through its backend descriptors (cudnn_graph.h).
// The forward is the graph Q·Kᵀ → ×scale → causal mask → softmax (with
// its log-sum-exp saved) → ·V, and the backward the matching graph for
// dQ, dK and dV; cuDNN recognises these graphs and runs one fused kernel
// each. cuDNN's C++ front end, which builds the same graphs, is a
// header-only library that Debian does not package, so the descriptors
// are set here directly.
//
// Deterministic: the backward's graph writes dQ straight from dS·K (no
// fp32 accumulator added to by atomics; cuDNN keeps dP in its workspace
// instead), and an engine whose numerical notes say "non-deterministic"
// is never picked.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9, found by the
// dynamic loader: LD_LIBRARY_PATH or the system's paths), the first time
// a CudnnAttention runs. A worker that never asks for it does not need
// cuDNN installed. Built only under --config=cuda.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

// What CudnnAttention's calls return when cuDNN failed: error() says why.
constexpr int kCudnnError = (1 << 16) + 2000;

// Whether cuDNN's engines handle this precision and shape: bf16, and a
// head size that is a multiple of 8 up to 128.
inline bool CudnnAttentionSupports(ActType act, int C, int NH) {
  if (act != ActType::kBf16 || NH <= 0 || C % NH != 0) return false;
  const int hs = C / NH;
  return hs % 8 == 0 && hs <= 128;
}

// Whether libcudnn.so.9 loads, has the entry points used and is cuDNN 9
// or later (loading it, once per process, if it has not been); if not,
// `why` (when given) says why, as a CudnnAttention's error() would.
bool CudnnAttentionLoads(std::string* why = nullptr);

// One per model (or test): a cuDNN handle on the current device, the
// execution plans built so far (one per shape and direction, built on
// first use and kept), and their GPU workspace. Not thread-safe.
class CudnnAttention {
 public:
  CudnnAttention();
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // out (B, T, C) bf16; stats (B, NH, T) fp32: each row's natural-log
  // sum-exp of the scaled, masked scores (cuDNN's, not flash_attention.h's
  // log2 form), which only Backward reads. Returns 0, a cudaError_t, or
  // kCudnnError.
  int Forward(void* out, float* stats, const void* qkv, int B, int T, int C, int NH, void* stream);

  // dqkv (B, T, 3C) bf16, overwritten, from dout (B, T, C). out and stats
  // are Forward's. softmax_sum (B, NH, T) fp32: scratch (each row's
  // dout·out).
  int Backward(void* dqkv, float* softmax_sum, const void* dout, const void* out, const void* qkv,
               const float* stats, int B, int T, int C, int NH, void* stream);

  // Why the last call returned kCudnnError (cuDNN's own message where it
  // gave one); empty after a success.
  const std::string& error() const;

  // cuDNN's version as cudnnGetVersion() gives it (91900 for 9.19.0), once
  // loaded; 0 before.
  long version() const;

  // The engines picked so far, e.g. "forward B=8 T=1024 NH=12 hs=64:
  // engine 8", one line each.
  std::string Describe() const;

  // GPU workspace held (the largest plan's), bytes.
  size_t workspace_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// For tests without a GPU: builds every tensor and operation descriptor of
// both graphs for this shape, which cuDNN checks (types, dims, strides,
// attributes) without a device, stopping short of the operation graph,
// which needs a cuDNN handle and so a GPU. Returns "" when all of them
// finalize, else what failed (cuDNN not loadable included).
std::string CudnnAttentionCheckDescriptors(int B, int T, int C, int NH);

}  // namespace muster::kernels::fast
