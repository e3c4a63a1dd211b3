// Causal flash attention with head size 64 (GPT-2's): the scores never
// leave the chip. A block of 4 warps owns 64 or 128 queries (keys in the
// dK/dV kernel; FlashTiling below) and streams the other side through
// shared memory in tiles of 64; the products go through the tensor cores
// (mma.sync, fp32 accumulation) with an online softmax, and steps above
// the diagonal are skipped. The backward recomputes the probabilities
// from the saved log-sum-exp.
//
// Two operand types (FlashMath): bf16 activations on m16n8k16 (precision
// bf16), or fp32 activations whose products take TF32 operands on
// m16n8k8 (precision tf32, where the GEMMs are TF32 too). Exact fp32 has
// no flash kernel: it uses attention.h's GEMM path.
//
// Deterministic without atomics: the backward runs as two kernels, one
// per key block (dK, dV: sums over queries) and one per query block (dQ:
// sums over keys), each adding its terms in a fixed order. The dQ kernel
// either recomputes the scores, probabilities and dP of its tiles (three
// products and an exponential a score), or, with FlashTiling::stored_ds,
// reads the dS that the dK/dV kernel wrote to scratch (bf16, the causal
// tiles only) and multiplies it by K (one product).
//
// Layout as attention.h: qkv (B, T, 3C), out (B, T, C), of the math's
// storage type, with NH heads of hs = C / NH = 64. Other shapes use
// attention.h's GEMM path.
#pragma once

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

constexpr int kFlashHeadSize = 64;

// What the kernels multiply on the tensor cores, and how activations are
// stored: bf16, or fp32 rounded to TF32 in the products.
enum class FlashMath { kBf16, kTf32 };

// Whether the flash kernels handle this shape (either math).
inline bool FlashAttentionSupports(int C, int NH) {
  return NH > 0 && C % NH == 0 && C / NH == kFlashHeadSize;
}

// How one kernel is tiled: the rows (queries for the forward and dQ, keys
// for dK and dV) each warp owns, 16 or 32 (a block is 4 warps: 64 or 128
// rows); the step of its inner loop through the other side's tiles of 64
// rows (16, 32 or 64); values_in_registers (dK/dV only): the values' MMA
// fragments stay in registers rather than being read from shared memory
// at each use; blocks_per_sm: 0, or the blocks per SM the compiler must
// fit (it caps the registers: 4 blocks of 128 threads, 128 registers).
struct FlashKernelTiling {
  int rows;
  int step;
  bool values_in_registers;
  int blocks_per_sm;
};
// The tiling of each kernel. The member defaults are bf16's, the fastest
// of its compiled tilings on an H100 (tools/bench_flash times each);
// FlashDefaultTiling gives each math's. fast_cuda_test checks every
// compiled tiling. Compiled (rows/step), bf16: forward 32/64, 32/32,
// 16/64, 16/32; dK/dV 16/32 (values in registers or not), 16/64 (either),
// 16/16 with values in shared memory at 4 blocks/SM, 32/32 in shared
// memory; dQ 16/64, 16/32, 16/16 at 4 blocks/SM, 32/32. tf32: forward
// 16/64, 16/32, 32/32; dK/dV 16/32, 16/16 and 32/16, values in shared
// memory; dQ 16/32, 16/16. Any other tiling is cudaErrorInvalidValue.
// stored_ds (bf16 only): the dK/dV kernel also writes dS to the
// backward's scratch, and the dQ kernel is a product of those tiles with
// K; its step is then a whole tile (64). Compiled with stored_ds: dK/dV
// 16/32 with the values in registers at 3 blocks/SM (168 registers; 175
// uncapped, which fits 2), or in shared memory; dQ 16/64 and 32/64.
//
// bf16's default stores dS (dK/dV 16/32 with the values in registers at 3
// blocks/SM, dQ 32/64): on an H200 its backward took 0.246 ms at B=8,
// T=1024, NH=12, where recomputing dQ took 0.259-0.268 ms with each
// compiled dQ tiling (tools/bench_flash, docs/benchmarks.md).
struct FlashTiling {
  FlashKernelTiling forward{32, 64, false, 0};
  FlashKernelTiling key_value{16, 32, true, 3};
  FlashKernelTiling query{32, 64, false, 0};
  bool stored_ds = true;
};
// tf32's defaults: forward 32/32, dK/dV 32/16 with values in shared
// memory, dQ 16/32, the fastest of its compiled tilings on an H100 and an
// H200 (forward 0.144 ms against 0.194 at 16/64; fp32 tiles and fragments
// take twice the registers and shared memory of bf16's, so steps are
// shorter).
FlashTiling FlashDefaultTiling(FlashMath math);

// out (B, T, C); lse (B, NH, T) fp32: each row's log2-sum-exp of the
// scaled scores, for the backward. qkv and out are bf16 for kBf16, fp32
// for kTf32. With the math's default tiling, or `tiling`.
int FlashAttentionForward(FlashMath math, void* out, float* lse, const void* qkv, int B, int T,
                          int C, int NH, void* stream);
int FlashAttentionForward(FlashMath math, void* out, float* lse, const void* qkv, int B, int T,
                          int C, int NH, void* stream, const FlashTiling& tiling);

// The backward's scratch, in floats: each row's delta (B, NH, T), and
// with stored_ds each (b, h)'s dS tiles at and below the diagonal (64 x
// 64 bf16 each; 107 MB at B=8, T=1024, NH=12). 0 for a tiling that is not
// compiled.
size_t FlashAttentionBackwardScratchFloats(FlashMath math, int B, int T, int NH);
size_t FlashAttentionBackwardScratchFloats(FlashMath math, int B, int T, int NH,
                                           const FlashTiling& tiling);

// dqkv (B, T, 3C), overwritten, from dout (B, T, C), in the math's storage
// type. out and lse are the forward's. scratch: the floats
// FlashAttentionBackwardScratchFloats asks for the same tiling.
int FlashAttentionBackward(FlashMath math, void* dqkv, float* scratch, const void* dout,
                           const void* out, const void* qkv, const float* lse, int B, int T, int C,
                           int NH, void* stream);
int FlashAttentionBackward(FlashMath math, void* dqkv, float* scratch, const void* dout,
                           const void* out, const void* qkv, const float* lse, int B, int T, int C,
                           int NH, void* stream, const FlashTiling& tiling);

}  // namespace muster::kernels::fast
