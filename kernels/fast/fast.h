// The fused CUDA engine's kernels (GPT-2 training in fp32, tf32 or bf16),
// in the manner of llm.c's train_gpt2.cu: cuBLASLt GEMMs with fused
// epilogues, a fused classifier, fused residual + LayerNorm, 128-bit
// loads, and no atomics anywhere, so a step's bits do not depend on
// scheduling. The CPU back end (kernels/*.h) is the reference they are
// tested against (tests/kernels/fast_cuda_test.cc).
//
// This header holds what every op family shares. Each family has its own
// header beside it (gemm.h, attention.h, layernorm.h, classifier.h,
// encoder.h, adamw.h). Built only under --config=cuda.
//
// Conventions:
//   - Pointers are device pointers. Activations are "act" tensors stored
//     as ActType (void* in the API); parameters are fp32 master weights
//     or their bf16 copy; gradients of parameters are fp32.
//   - Every launcher enqueues on `stream` (a cudaStream_t as void*) and
//     returns 0, a cudaError_t, or kCublasErrorBase + a cublasStatus_t
//     (kernels/matmul.h), or kNoGemmAlgorithm.
//   - Shapes: B batch, T time, C channels, NH heads, V vocab, Vp padded
//     vocab, BT = B*T rows; row-major, written next to each argument.
//   - REQUIRES for every launcher: C (and every row width) a multiple of
//     8, so rows start on 16 bytes and 128-bit accesses never straddle
//     them; see RowWidthOk.
#pragma once

#include <cstddef>

namespace muster::kernels::fast {

// Storage of activations: fp32 (precision fp32 or tf32) or bf16.
enum class ActType { kF32, kBf16 };

inline size_t ActBytes(ActType act) { return act == ActType::kBf16 ? 2 : 4; }

// How a launcher writes the parameter gradient it computes: added into
// what the buffer holds (kAdd), or written over it (kOverwrite: the first
// writer of a gradient since the model's ZeroGrad, which marks the
// buffers zero without clearing them; worker/model/model_cuda.cc). The
// two give the same bits, as 0 + x is x (but for the sign of a zero, which
// nothing downstream can see), and kOverwrite neither reads the buffer
// nor needs it cleared first.
enum class GradWrite { kAdd, kOverwrite };

// cuBLASLt found no algorithm for a GEMM's shape and types.
constexpr int kNoGemmAlgorithm = (1 << 16) + 1000;

// Every row width the kernels see must be a multiple of this.
constexpr int kRowMultiple = 8;
inline bool RowWidthOk(long long width) { return width > 0 && width % kRowMultiple == 0; }

}  // namespace muster::kernels::fast
