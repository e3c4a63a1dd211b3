// Flash attention forward and backward (flash_attention.h) on mma.sync.
//
// A block is 4 warps; each warp owns kM 16-row MMA tiles (16 or 32 rows:
// with 32, each B fragment read from shared memory feeds two MMAs per
// n-tile, at the price of registers), held in registers. The other side
// streams through shared memory in 64-row tiles, double-buffered, taken
// kStep rows at a time. flash_attention.h's FlashTiling picks both per
// kernel.
//
// The kernels are templates over their operands (Bf16Mma, Tf32Mma below):
// the loops, the online softmax, the masking and the pipelining are one
// code for both; the MMA instruction, the tiles' element type and padding,
// and the reading of fragments differ. bf16 fragments of m16n8k16 (PTX
// ISA, "mma.m16n8k16"), with g = lane / 4 and q = lane % 4:
//   A (16 x 16, row-major): a0 (g, 2q..2q+1), a1 (g+8, 2q..), a2 (g, 2q+8..),
//                           a3 (g+8, 2q+8..)
//   B (16 x 8):             b0 (k = 2q..2q+1, n = g), b1 (k = 2q+8.., n = g)
//   C (16 x 8, fp32):       c0 c1 (g, 2q..2q+1), c2 c3 (g+8, 2q..2q+1)
// An accumulator tile pair (n-tiles 2j, 2j+1) is exactly the A fragment of
// the next product's k-chunk j, so probabilities go from one product to
// the next in registers (for TF32, one n-tile is one k-chunk: Tf32Mma).
//
// Tiles are staged in shared memory as [row][64 dims] with rows padded to
// 72 bf16 (144 bytes), so the 8 rows an ldmatrix phase reads fall in
// different banks, or to 68 floats (Tf32Mma).
#include <atomic>
#include <cmath>
#include <cstdint>

#include "kernels/fast/common.cuh"
#include "kernels/fast/flash_attention.h"

namespace muster::kernels::fast {
namespace {

constexpr int kTile = 64;  // rows of a streamed tile (keys, or queries for dK/dV)
constexpr int kHs = kFlashHeadSize;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// The backward applies the softmax scale 1/sqrt(64) = 1/8 to dK and dQ
// once, at the store, rather than to every dS: exact only for a power of
// two.
static_assert(kHs == 64, "the backward's scale must stay a power of two");
// How far (log2) a step's scores may exceed the forward's running max
// before it is raised and the output rescaled: terms stay <= 2^8.
constexpr float kRescaleLog2 = 8.0f;

struct Frag {
  uint32_t r[4];
};

// Declares `name`, the kernel's dynamic shared memory as bytes (on the
// emulation, simt's). A macro, not a function: it expands to the
// declaration itself, so the kernels compile as they did when each
// spelled it out (a function returning the pointer changed four kernels'
// register allocation).
#ifdef MUSTER_SIMT
#define MUSTER_DYNAMIC_SHARED(name) unsigned char* name = simt::DynamicShared()
#else
#define MUSTER_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ldmatrix.sync.aligned.m8n8.x4 (.trans with kTrans) of the b16 8x8
// matrices whose rows lane l addresses (p), into r[0..3].
template <bool kTrans>
__device__ __forceinline__ void LdMatrixX4(const bf16* p, uint32_t* r) {
#ifdef MUSTER_SIMT
  simt::LdMatrixX4(p, r, kTrans);
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
#endif
}

// What the kernels below take from their operand type: the element T
// stored in memory and in shared-memory tiles, the MMA (its k, kK), a
// tile row's padded length kLd, and how fragments are read from tiles
// and from accumulators. Bf16Mma: bf16 storage, m16n8k16, ldmatrix.
// Tf32Mma: fp32 storage, m16n8k8 on TF32 operands.
struct Bf16Mma {
  using T = bf16;
  static constexpr int kK = 16;
  static constexpr int kLd = kHs + 8;  // 144 bytes: an ldmatrix phase's 8 rows in 8 bank groups

  static __device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0,
                                             uint32_t b1) {
#ifdef MUSTER_SIMT
    simt::MmaBf16(c, a, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }

  static __device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ uint32_t Load32(const bf16* p) {
    return *reinterpret_cast<const uint32_t*>(p);
  }
  // Two neighbouring outputs, as one store: *reinterpret_cast<Pair*>(p) =
  // MakePair(lo, hi).
  using Pair = uint32_t;
  static __device__ __forceinline__ Pair MakePair(float lo, float hi) { return Pack2(lo, hi); }

  // A fragment (rows row0.., k-chunk kc) of a row-major [row][dim] tile.
  static __device__ __forceinline__ Frag LoadA(const bf16* tile, int row0, int kc, int g, int q) {
    const bf16* top = tile + (row0 + g) * kLd + 16 * kc + 2 * q;
    const bf16* bottom = top + 8 * kLd;
    return Frag{{Load32(top), Load32(bottom), Load32(top + 8), Load32(bottom + 8)}};
  }
  // The same fragment with one ldmatrix.x4: matrix i covers rows + 8 (i &
  // 1), dims + 8 (i >> 1), which is the order of a0..a3.
  static __device__ __forceinline__ Frag LoadAShared(const bf16* tile, int row0, int kc, int lane) {
    const int matrix = lane / 8, row = lane % 8;
    const bf16* p = tile + (row0 + 8 * (matrix & 1) + row) * kLd + 16 * kc + 8 * (matrix >> 1);
    Frag f;
    LdMatrixX4<false>(p, f.r);
    return f;
  }
  // The A fragment (rows r0.., k-chunk at k0) of A[r][k] = tile[k][r], a
  // [k][r] tile read with ldmatrix.x4.trans: matrix i is tile rows k0 +
  // 8 (i >> 1).., columns r0 + 8 (i & 1).., and .trans gives a lane
  // (tile rows 2q, 2q + 1, column g): A's (r = g, k = 2q..), as LoadAShared.
  static __device__ __forceinline__ Frag LoadATransposed(const bf16* tile, int r0, int k0,
                                                         int lane) {
    const int matrix = lane / 8, row = lane % 8;
    const bf16* p = tile + (k0 + 8 * (matrix >> 1) + row) * kLd + r0 + 8 * (matrix & 1);
    Frag f;
    LdMatrixX4<true>(p, f.r);
    return f;
  }
  // The B fragments of two neighbouring n-tiles (n0.. and n0 + 8..) for
  // k-chunk k0, with one ldmatrix.x4: b[0], b[1] for the first tile, b[2],
  // b[3] for the second. Lane l gives the address of row l % 8 of 8x8
  // matrix l / 8; matrix i covers k + 8 (i & 1), n + 8 (i >> 1).
  //   Contiguous: B[k][n] = tile[n][k] (k along a row's dims). The 8x8
  //   matrices' rows are n; without .trans a lane gets (row g, columns 2q,
  //   2q + 1): (n = g, k = 2q..), B's layout.
  //   Strided: B[k][n] = tile[k][n] (k along rows). The rows are k; .trans
  //   gives a lane (rows 2q, 2q + 1, column g): (k = 2q.., n = g).
  static __device__ __forceinline__ void LoadBContiguousPair(const bf16* tile, int n0, int k0,
                                                             int lane, uint32_t* b) {
    const int matrix = lane / 8, row = lane % 8;
    const bf16* p = tile + (n0 + 8 * (matrix >> 1) + row) * kLd + k0 + 8 * (matrix & 1);
    LdMatrixX4<false>(p, b);
  }
  static __device__ __forceinline__ void LoadBStridedPair(const bf16* tile, int n0, int k0,
                                                          int lane, uint32_t* b) {
    const int matrix = lane / 8, row = lane % 8;
    const bf16* p = tile + (k0 + 8 * (matrix & 1) + row) * kLd + n0 + 8 * (matrix >> 1);
    LdMatrixX4<true>(p, b);
  }
  // The A fragment of k-chunk j from accumulator n-tiles 2j and 2j+1.
  static __device__ __forceinline__ Frag AccToA(const float (*acc)[4], int j) {
    return Frag{{Pack2(acc[2 * j][0], acc[2 * j][1]), Pack2(acc[2 * j][2], acc[2 * j][3]),
                 Pack2(acc[2 * j + 1][0], acc[2 * j + 1][1]),
                 Pack2(acc[2 * j + 1][2], acc[2 * j + 1][3])}};
  }
};

// TF32: fp32 in memory and in the tiles, each operand rounded to TF32 as
// it enters a fragment. Fragments of m16n8k8 (PTX ISA, "mma.m16n8k8"):
//   A (16 x 8, row-major): a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4)
//   B (8 x 8):             b0 (k = q, n = g), b1 (k = q+4, n = g)
//   C (16 x 8, fp32):      as m16n8k16's
// There is no ldmatrix for 32-bit elements, so fragments are read one
// element at a time; rows padded to 68 floats put the 32 lanes' reads of
// either pattern below in 32 different banks.
struct Tf32Mma {
  using T = float;
  static constexpr int kK = 8;
  static constexpr int kLd = kHs + 4;

  static __device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0,
                                             uint32_t b1) {
#ifdef MUSTER_SIMT
    simt::MmaTf32(c, a, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  // Rounds to the nearest TF32 (ties away from zero) by adding half of
  // TF32's last place; the MMA ignores the 13 bits below it. One integer
  // add, where cvt.rna.tf32.f32 would be a conversion per element.
  static __device__ __forceinline__ uint32_t Round(float x) { return __float_as_uint(x) + 0x1000u; }
  using Pair = float2;
  static __device__ __forceinline__ Pair MakePair(float lo, float hi) {
    return make_float2(lo, hi);
  }

  static __device__ __forceinline__ Frag LoadA(const float* tile, int row0, int kc, int g, int q) {
    const float* top = tile + (row0 + g) * kLd + 8 * kc + q;
    const float* bottom = top + 8 * kLd;
    return Frag{{Round(top[0]), Round(bottom[0]), Round(top[4]), Round(bottom[4])}};
  }
  static __device__ __forceinline__ Frag LoadAShared(const float* tile, int row0, int kc,
                                                     int lane) {
    return LoadA(tile, row0, kc, lane / 4, lane % 4);
  }
  // Contiguous: B[k][n] = tile[n][k]; b[2], b[3] are the n-tile at n0 + 8.
  static __device__ __forceinline__ void LoadBContiguousPair(const float* tile, int n0, int k0,
                                                             int lane, uint32_t* b) {
    const float* p = tile + (n0 + lane / 4) * kLd + k0 + lane % 4;
    b[0] = Round(p[0]);
    b[1] = Round(p[4]);
    b[2] = Round(p[8 * kLd]);
    b[3] = Round(p[8 * kLd + 4]);
  }
  // Strided: B[k][n] = tile[k][n], with the k-chunk's rows in AccToA's
  // order: k = q is row k0 + 2q, k = q + 4 is row k0 + 2q + 1.
  static __device__ __forceinline__ void LoadBStridedPair(const float* tile, int n0, int k0,
                                                          int lane, uint32_t* b) {
    const float* p = tile + (k0 + 2 * (lane % 4)) * kLd + n0 + lane / 4;
    b[0] = Round(p[0]);
    b[1] = Round(p[kLd]);
    b[2] = Round(p[8]);
    b[3] = Round(p[kLd + 8]);
  }
  // The A fragment of k-chunk j (columns 8j..8j+7) from accumulator n-tile
  // j. A lane holds columns 2q and 2q + 1 of rows g and g + 8, where A
  // wants columns q and q + 4; a sum over k may take its terms in any
  // order, so k = q here stands for column 2q and k = q + 4 for column
  // 2q + 1, and LoadBStridedPair reads B's rows in that same order.
  static __device__ __forceinline__ Frag AccToA(const float (*acc)[4], int j) {
    return Frag{{Round(acc[j][0]), Round(acc[j][2]), Round(acc[j][1]), Round(acc[j][3])}};
  }
};

// The A fragments of a warp's M row tiles (rows row0 + 16m..) of a
// [row][64 dims] tile, all k-chunks: the operand a warp keeps in
// registers for the whole loop.
template <class Op, int M>
__device__ __forceinline__ void LoadRowFragments(Frag (*a)[kHs / Op::kK],
                                                 const typename Op::T* tile, int row0, int g,
                                                 int q) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int kc = 0; kc < kHs / Op::kK; ++kc) a[m][kc] = Op::LoadA(tile, row0 + 16 * m, kc, g, q);
}

// Copies rows [row0, row0 + kRows) of one head's slice (64 dims at `base`,
// rows `row_stride` elements apart) into a padded tile; rows >= T are 0.
template <class Op, int kRows, typename E = typename Op::T>
__device__ __forceinline__ void LoadTile(E* tile, const E* base, size_t row_stride, int row0,
                                         int T) {
  constexpr int kPack = Pack<E>::kSize;
  for (int i = threadIdx.x; i < kRows * (kHs / kPack); i += kThreads) {
    const int r = i / (kHs / kPack), c = (i % (kHs / kPack)) * kPack;
    Pack<E> v;
    if (row0 + r < T) {
      v = LoadPack(base + (row0 + r) * row_stride + c);
    } else {
#pragma unroll
      for (int e = 0; e < kPack; ++e) v.v[e] = FromFloat<E>(0.0f);
    }
    StorePack(tile + r * Op::kLd + c, v);
  }
}

// LoadTile with cp.async: the copies land in shared memory in the
// background; rows >= T are zero-filled (a source size of 0). The caller
// commits the group and waits for it (WaitTiles) before reading.
template <class Op, typename E = typename Op::T>
__device__ __forceinline__ void LoadTileAsync(E* tile, const E* base, size_t row_stride, int row0,
                                              int T) {
  constexpr int kPack = Pack<E>::kSize;
  for (int i = threadIdx.x; i < kTile * (kHs / kPack); i += kThreads) {
    const int r = i / (kHs / kPack), c = (i % (kHs / kPack)) * kPack;
    const bool valid = row0 + r < T;
    const E* source = valid ? base + (row0 + r) * row_stride + c : base;
#ifdef MUSTER_SIMT
    simt::CpAsync16(tile + r * Op::kLd + c, source, valid ? 16 : 0);
#else
    const uint32_t destination =
        static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * Op::kLd + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source),
                 "r"(valid ? 16 : 0));
#endif
  }
}
__device__ __forceinline__ void CommitTiles() {
#ifdef MUSTER_SIMT
  simt::CpAsyncCommit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most `pending` committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void WaitTiles() {
#ifdef MUSTER_SIMT
  simt::CpAsyncWait(pending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// Starts copying the keys and values of rows [row0, row0 + 64) of a
// sequence's qkv (`seq` at this head's q) into k_tile and v_tile, as one
// group.
template <class Op, typename E = typename Op::T>
__device__ __forceinline__ void LoadKeyValuesAsync(E* k_tile, E* v_tile, const E* seq,
                                                   size_t stride, int C, int row0, int T) {
  LoadTileAsync<Op>(k_tile, seq + C, stride, row0, T);
  LoadTileAsync<Op>(v_tile, seq + 2 * C, stride, row0, T);
  CommitTiles();
}

// Iteration kt of a loop over key tiles 0..last, each ending with a
// barrier: starts copying tile kt + 1 into the other buffer (last read in
// iteration kt - 1), then waits until tile kt has landed for every thread.
template <class Op, typename E = typename Op::T>
__device__ __forceinline__ void NextKeyValueTile(E (*k_tiles)[kTile * Op::kLd],
                                                 E (*v_tiles)[kTile * Op::kLd], const E* seq,
                                                 size_t stride, int C, int kt, int last, int T) {
  if (kt < last) {
    LoadKeyValuesAsync<Op>(k_tiles[(kt + 1) & 1], v_tiles[(kt + 1) & 1], seq, stride, C,
                           (kt + 1) * kTile, T);
    WaitTiles<1>();
  } else {
    WaitTiles<0>();
  }
  __syncthreads();
}

template <int N>
__device__ __forceinline__ void Zero(float (*acc)[4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
}

// S[m] (16 x 8N) = A[m] (16 rows x 64 dims, in registers) @ rows^T over
// the first 8N rows of `rows`, read as B[k = dim][n = row]. Each B read
// feeds 2M MMAs.
template <class Op, int M, int N>
__device__ __forceinline__ void ProductWithRows(float (*s)[N][4], const Frag (*a)[kHs / Op::kK],
                                                const typename Op::T* rows, int lane) {
#pragma unroll
  for (int m = 0; m < M; ++m) Zero<N>(s[m]);
#pragma unroll
  for (int kc = 0; kc < kHs / Op::kK; ++kc) {
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      uint32_t b[4];
      Op::LoadBContiguousPair(rows, 8 * j, Op::kK * kc, lane, b);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Op::Mma(s[m][j], a[m][kc].r, b[0], b[1]);
        Op::Mma(s[m][j + 1], a[m][kc].r, b[2], b[3]);
      }
    }
  }
}

// ProductWithRows with A read from shared memory: rows a_row0 + 16m.. of
// a_tile, one k-chunk at a time (saves the registers of a whole A).
template <class Op, int M, int N>
__device__ __forceinline__ void ProductWithRowsShared(float (*s)[N][4],
                                                      const typename Op::T* a_tile, int a_row0,
                                                      const typename Op::T* rows, int lane) {
#pragma unroll
  for (int m = 0; m < M; ++m) Zero<N>(s[m]);
#pragma unroll
  for (int kc = 0; kc < kHs / Op::kK; ++kc) {
    Frag a[M];
#pragma unroll
    for (int m = 0; m < M; ++m) a[m] = Op::LoadAShared(a_tile, a_row0 + 16 * m, kc, lane);
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      uint32_t b[4];
      Op::LoadBContiguousPair(rows, 8 * j, Op::kK * kc, lane, b);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Op::Mma(s[m][j], a[m].r, b[0], b[1]);
        Op::Mma(s[m][j + 1], a[m].r, b[2], b[3]);
      }
    }
  }
}

// acc[m] (16 x 64 dims) += a[m] (16 x kK, an A fragment) @ rows k0..k0 +
// kK of `rows` (64 dims each), read as B[k = row][n = dim].
template <class Op, int M>
__device__ __forceinline__ void AccumulateChunk(float (*acc)[kHs / 8][4], const Frag* a,
                                                const typename Op::T* rows, int k0, int lane) {
#pragma unroll
  for (int j = 0; j < kHs / 8; j += 2) {
    uint32_t b[4];
    Op::LoadBStridedPair(rows, 8 * j, k0, lane, b);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      Op::Mma(acc[m][j], a[m].r, b[0], b[1]);
      Op::Mma(acc[m][j + 1], a[m].r, b[2], b[3]);
    }
  }
}

// acc[m] (16 x 64 dims) += P[m] (16 x 8N, accumulator layout) @ the first
// 8N rows of `rows` (64 dims each), read as B[k = row][n = dim].
template <class Op, int M, int N>
__device__ __forceinline__ void AccumulateProduct(float (*acc)[kHs / 8][4], const float (*p)[N][4],
                                                  const typename Op::T* rows, int lane) {
#pragma unroll
  for (int kc = 0; kc < 8 * N / Op::kK; ++kc) {
    Frag a[M];
#pragma unroll
    for (int m = 0; m < M; ++m) a[m] = Op::AccToA(p[m], kc);
    AccumulateChunk<Op, M>(acc, a, rows, Op::kK * kc, lane);
  }
}

// Sets each score whose key follows its query, or is past T, to `fill`:
// for a step that crosses the diagonal. Element (m, j, e) of a warp's
// accumulators is at row row0 + 16m + g + 8(e >> 1), column col0 + 8j +
// 2q + (e & 1); rows are queries and columns keys, or the other way round
// (kKeyRows: the dK/dV kernel's S^T). The caller branches once per step
// (warp-uniform) and this selects: written as a condition around each
// score's own arithmetic, the compiler made a branch per score, and the
// kernels ran 11-116% slower (tools/bench_flash; docs/cuda-engine.md).
template <int M, int N, bool kKeyRows>
__device__ __forceinline__ void MaskAfterDiagonal(float (*s)[N][4], int row0, int col0, int T,
                                                  float fill, int g, int q) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 16 * m + g + 8 * (e >> 1), col = col0 + 8 * j + 2 * q + (e & 1);
        const int key = kKeyRows ? row : col, query = kKeyRows ? col : row;
        s[m][j][e] = key <= query && key < T ? s[m][j][e] : fill;
      }
}

// Writes a warp's 16 x 64 accumulator (times `scale`) as rows at `base` +
// row * row_stride, for rows < T.
template <class Op>
__device__ __forceinline__ void StoreRows(typename Op::T* base, size_t row_stride, int row0, int T,
                                          const float (*acc)[4], float scale, int g, int q) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= T) continue;
    typename Op::T* out = base + row * row_stride;
#pragma unroll
    for (int j = 0; j < kHs / 8; ++j) {
      *reinterpret_cast<typename Op::Pair*>(out + 8 * j + 2 * q) =
          Op::MakePair(acc[j][2 * half] * scale, acc[j][2 * half + 1] * scale);
    }
  }
}

// The forward's and the dQ kernel's shared memory: two buffers each of
// keys and values. bf16's fit the 48 KB a static array may have; fp32's
// (70 KB) are dynamic shared memory (TileBuffersBytes), allowed at launch.
template <class Op>
__host__ __device__ constexpr size_t TileBuffersBytes() {
  return 4 * kTile * Op::kLd * sizeof(typename Op::T);
}
template <class Op, typename E = typename Op::T>
__device__ __forceinline__ void KeyValueBuffers(E (**k_tiles)[kTile * Op::kLd],
                                                E (**v_tiles)[kTile * Op::kLd]) {
  if constexpr (TileBuffersBytes<Op>() <= 48 * 1024) {
    __shared__ __align__(16) E k_static[2][kTile * Op::kLd];
    __shared__ __align__(16) E v_static[2][kTile * Op::kLd];
    *k_tiles = k_static;
    *v_tiles = v_static;
  } else {
    MUSTER_DYNAMIC_SHARED(shared);
    *k_tiles = reinterpret_cast<E(*)[kTile * Op::kLd]>(shared);
    *v_tiles = *k_tiles + 2;
  }
}

// ---- forward: block = 64 kM queries of one (b, h); the online softmax
// steps through each key tile kStep keys at a time ----
template <class Op, int kM, int kStep, int kMinBlocks, typename E = typename Op::T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ForwardKernel(E* out, float* lse, const E* qkv, int T, int C, int NH, float scale_log2) {
  // Two buffers: tile kt + 1 is copied in while tile kt is used.
  E(*k_tiles)[kTile * Op::kLd];
  E(*v_tiles)[kTile * Op::kLd];
  KeyValueBuffers<Op>(&k_tiles, &v_tiles);
  constexpr int kWarpRows = 16 * kM, kBlockRows = kWarps * kWarpRows;
  const int blocks = (T + kBlockRows - 1) / kBlockRows;
  const int qb = blocks - 1 - blockIdx.x;  // longest rows first
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const E* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const int q0 = qb * kBlockRows;
  const int warp_row0 = q0 + kWarpRows * warp, warp_last = warp_row0 + kWarpRows - 1;

  // The block's queries (at most 128) pass through the two key buffers
  // (contiguous: 128 rows).
  E* staging = &k_tiles[0][0];
  LoadTile<Op, kBlockRows>(staging, seq, stride, q0, T);
  __syncthreads();
  Frag qa[kM][kHs / Op::kK];
  LoadRowFragments<Op, kM>(qa, staging, kWarpRows * warp, g, q);
  __syncthreads();

  float o[kM][kHs / 8][4];
  float m_run[kM][2], l[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    Zero<kHs / 8>(o[m]);
    m_run[m][0] = m_run[m][1] = -INFINITY;
    l[m][0] = l[m][1] = 0.0f;
  }
  // The last key any of the block's rows sees.
  const int last = min(q0 + kBlockRows - 1, T - 1) / kTile;
  LoadKeyValuesAsync<Op>(k_tiles[0], v_tiles[0], seq, stride, C, 0, T);
  for (int kt = 0; kt <= last; ++kt) {
    NextKeyValueTile<Op>(k_tiles, v_tiles, seq, stride, C, kt, last, T);
#pragma unroll
    for (int step = 0; step < kTile / kStep; ++step) {
      const int k0 = kt * kTile + step * kStep;  // the step's first key
      // Steps and warps are aligned, so a warp that sees any key of the
      // step has k0 <= its first row: every one of its rows sees key k0.
      if (k0 > warp_last) continue;
      const E* k_rows = k_tiles[kt & 1] + step * kStep * Op::kLd;
      const E* v_rows = v_tiles[kt & 1] + step * kStep * Op::kLd;
      // Only a step reaching past the warp's first row (or past T) has
      // keys after a row.
      const bool masked = k0 + kStep - 1 > warp_row0 || k0 + kStep > T;
      // Raw scores: the scale is applied in the exponent's FMA.
      float s[kM][kStep / 8][4];
      ProductWithRows<Op, kM, kStep / 8>(s, qa, k_rows, lane);
      if (masked) MaskAfterDiagonal<kM, kStep / 8, false>(s, warp_row0, k0, T, -INFINITY, g, q);
      // Each row's max over the step (a row's 8 columns are spread over
      // the 4 lanes of a quad).
      float step_max[kM][2];
      bool raise = false;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float x = -INFINITY;
#pragma unroll
          for (int j = 0; j < kStep / 8; ++j) {
            x = fmaxf(x, fmaxf(s[m][j][2 * half], s[m][j][2 * half + 1]));
          }
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
          x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
          step_max[m][half] = x;
          // Every row sees key 0 in its first step, so m_run is finite
          // after it (and -inf before, which this raises).
          raise |= (x - m_run[m][half]) * scale_log2 > kRescaleLog2;
        }
      }
      // The running max (a raw score) moves only when a step exceeds it
      // by more than kRescaleLog2 in the exponent; until then the terms
      // are relative to a max a little below the true one, at most
      // 2^kRescaleLog2, and o and l keep their scale. The rescaling of o
      // (a multiply per accumulator) then runs in the first step and in
      // the few later ones that raise the max. The decision is the
      // warp's (a vote), so the branch never diverges; the result is the
      // same for any max that is used consistently, up to rounding.
      if (__any_sync(0xffffffffu, raise)) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float m_new = fmaxf(m_run[m][half], step_max[m][half]);
            const float correction = Exp2((m_run[m][half] - m_new) * scale_log2);
            m_run[m][half] = m_new;
            l[m][half] *= correction;
#pragma unroll
            for (int j = 0; j < kHs / 8; ++j) {
              o[m][j][2 * half] *= correction;
              o[m][j][2 * half + 1] *= correction;
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float m_scaled = m_run[m][half] * scale_log2;
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < kStep / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[m][j][2 * half + e];
              x = Exp2(fmaf(x, scale_log2, -m_scaled));  // one FFMA, one MUFU.EX2
              sum += x;
            }
          }
          l[m][half] += sum;
        }
      }
      AccumulateProduct<Op, kM, kStep / 8>(o, s, v_rows, lane);
    }
    __syncthreads();  // done with this buffer before it is refilled
  }
  E* out_seq = out + static_cast<size_t>(b) * T * C + h * kHs;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = l[m][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int r = warp_row0 + 16 * m + g + 8 * half;
      if (r >= T) continue;
      const float inv = 1.0f / sum;
#pragma unroll
      for (int j = 0; j < kHs / 8; ++j) {
        *reinterpret_cast<typename Op::Pair*>(out_seq + static_cast<size_t>(r) * C + 8 * j +
                                              2 * q) =
            Op::MakePair(o[m][j][2 * half] * inv, o[m][j][2 * half + 1] * inv);
      }
      if (q == 0) lse[static_cast<size_t>(bh) * T + r] = m_run[m][half] * scale_log2 + log2f(sum);
    }
  }
}

// ---- backward ----
// delta[row] = sum_d dout[row, d] * out[row, d], per (b, h, t): one warp
// per row, 2 dims per lane.
template <typename E>
__global__ void DeltaKernel(float* delta, const E* dout, const E* out, int B, int T, int C,
                            int NH) {
  const size_t row = blockIdx.x * static_cast<size_t>(kWarps) + threadIdx.x / 32;
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const int lane = threadIdx.x % 32;
  const int t = static_cast<int>(row % T), h = static_cast<int>(row / T % NH);
  const int b = static_cast<int>(row / T / NH);
  const size_t offset = (static_cast<size_t>(b) * T + t) * C + h * kHs + 2 * lane;
  const float sum = ToFloat(dout[offset]) * ToFloat(out[offset]) +
                    ToFloat(dout[offset + 1]) * ToFloat(out[offset + 1]);
  const float total = WarpSum(sum);
  if (lane == 0) delta[row] = total;
}

// The stored dS (FlashTiling::stored_ds): for each (b, h), the tiles of
// query tile qt and key tile kt <= qt, in the order (0, 0), (1, 0), (1,
// 1), (2, 0), ...; a tile is 64 keys x 64 queries, [key][query], bf16 as
// the dK product's operand rounds it. Entries past T are 0, and so are
// those after the diagonal, including the steps the dK/dV kernel skips
// (written as zeros), so that any tile can be read whole. (The dQ kernel
// below reads no keys after its warp's last row; with the compiled
// tilings those are all in the skipped steps.)
__host__ __device__ constexpr size_t CausalTiles(int tiles) {
  return static_cast<size_t>(tiles) * (tiles + 1) / 2;
}
__device__ __forceinline__ size_t DsTileOffset(int bh, int tiles, int qt, int kt) {
  return (static_cast<size_t>(bh) * CausalTiles(tiles) + CausalTiles(qt) + kt) * kTile * kTile;
}

// Writes a warp's dS^T / scale of one step (16 keys x 8N queries,
// accumulator layout), or zeros, into a stored tile: `lane_row` is where
// the lane's first element goes (the tile's row of key g of the warp's
// 16, column 2q), `query0` the step's first column.
template <class Op, int N>
__device__ __forceinline__ void StoreDs(typename Op::T* lane_row, int query0, const float (*acc)[4],
                                        bool zero) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      *reinterpret_cast<typename Op::Pair*>(lane_row + 8 * half * kTile + query0 + 8 * j) =
          zero ? Op::MakePair(0.0f, 0.0f) : Op::MakePair(acc[j][2 * half], acc[j][2 * half + 1]);
    }
  }
}

// The key/value kernel's shared memory (dynamic: more than the 48 KB a
// static array may have): two buffers each of queries and dout, the
// block's values (64 * kM rows), and two buffers each of lse and delta.
template <class Op>
__host__ __device__ constexpr size_t QueryBuffersBytes() {
  return 2 * kTile * Op::kLd * sizeof(typename Op::T);
}
template <class Op>
__host__ __device__ constexpr size_t ValueTileBytes(int kM) {
  return kWarps * 16 * kM * Op::kLd * sizeof(typename Op::T);
}
template <class Op>
__host__ __device__ constexpr size_t KeyValueSharedBytes(int kM) {
  return 2 * QueryBuffersBytes<Op>() + ValueTileBytes<Op>(kM) + 2 * 2 * kTile * sizeof(float);
}

// dK and dV: block = 64 kM keys of one (b, h); loops over the query tiles
// at and below the diagonal, kStep queries at a time. The values' A
// fragments are kept in registers, or read from shared memory at each use
// (kValuesInRegisters false: fewer registers). Works with transposed
// scores: S^T = K Q^T. kStoreDs: also writes dS to `ds` (StoreDs; one key
// tile a block, kM = 1).
template <class Op, int kM, int kStep, bool kValuesInRegisters, int kMinBlocks, bool kStoreDs,
          typename E = typename Op::T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    KeyValueKernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta,
                   E* ds_store, int T, int C, int NH, float scale, float scale_log2) {
  static_assert(!kStoreDs || kM == 1, "a stored dS tile is one block's keys");
  constexpr int kWarpRows = 16 * kM, kBlockRows = kWarps * kWarpRows;
  constexpr size_t kQueryBuffersBytes = QueryBuffersBytes<Op>();
  MUSTER_DYNAMIC_SHARED(shared);
  // Two buffers of each per-query tile: tile qt + 1 is copied in while
  // tile qt is used.
  auto q_tiles = reinterpret_cast<E(*)[kTile * Op::kLd]>(shared);
  auto do_tiles = reinterpret_cast<E(*)[kTile * Op::kLd]>(shared + kQueryBuffersBytes);
  E* v_tile = reinterpret_cast<E*>(shared + 2 * kQueryBuffersBytes);
  auto lse_tiles =
      reinterpret_cast<float(*)[kTile]>(shared + 2 * kQueryBuffersBytes + ValueTileBytes<Op>(kM));
  float(*delta_tiles)[kTile] = lse_tiles + 2;
  const int tiles = (T + kTile - 1) / kTile;
  const int kb = blockIdx.x;  // the first key blocks see the most queries
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const E* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const E* dout_seq = dout + static_cast<size_t>(b) * T * C + h * kHs;
  const int k0 = kb * kBlockRows;
  const int warp_key0 = k0 + kWarpRows * warp, warp_last = warp_key0 + kWarpRows - 1;

  // The keys pass through the query buffers (contiguous; 128 rows hold
  // the block's keys) into registers; the values stay in shared memory.
  E* staging = &q_tiles[0][0];
  LoadTile<Op, kBlockRows>(staging, seq + C, stride, k0, T);
  LoadTile<Op, kBlockRows>(v_tile, seq + 2 * C, stride, k0, T);
  __syncthreads();
  Frag ka[kM][kHs / Op::kK];
  LoadRowFragments<Op, kM>(ka, staging, kWarpRows * warp, g, q);
  Frag va[kValuesInRegisters ? kM : 1][kHs / Op::kK];
  if constexpr (kValuesInRegisters) LoadRowFragments<Op, kM>(va, v_tile, kWarpRows * warp, g, q);
  __syncthreads();

  float dk[kM][kHs / 8][4], dv[kM][kHs / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    Zero<kHs / 8>(dk[m]);
    Zero<kHs / 8>(dv[m]);
  }
  // Copies in query tile `tile` (rows, dout, lse, delta) to buffer `buffer`.
  auto load_queries = [&](int tile, int buffer) {
    const int first = tile * kTile;
    LoadTileAsync<Op>(q_tiles[buffer], seq, stride, first, T);
    LoadTileAsync<Op>(do_tiles[buffer], dout_seq, C, first, T);
    CommitTiles();
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool valid = first + i < T;
      // A padded query row gets probability 0 (exp2(-inf)) and no delta.
      lse_tiles[buffer][i] = valid ? lse[static_cast<size_t>(bh) * T + first + i] : INFINITY;
      delta_tiles[buffer][i] = valid ? delta[static_cast<size_t>(bh) * T + first + i] : 0.0f;
    }
  };
  // Queries before the block's first key see none of its keys.
  const int first_tile = k0 / kTile;
  load_queries(first_tile, first_tile & 1);
  for (int qt = first_tile; qt < tiles; ++qt) {
    if (qt + 1 < tiles) {
      load_queries(qt + 1, (qt + 1) & 1);
      WaitTiles<1>();
    } else {
      WaitTiles<0>();
    }
    __syncthreads();  // tile qt has landed for every thread
    // kStoreDs: the lane's first element of dS tile (qt, kb).
    E* ds_row = nullptr;
    if constexpr (kStoreDs) {
      ds_row = ds_store + DsTileOffset(bh, tiles, qt, kb) + (kWarpRows * warp + g) * kTile + 2 * q;
    }
#pragma unroll
    for (int step = 0; step < kTile / kStep; ++step) {
      const int s0 = qt * kTile + step * kStep;  // the first query of this step
      // Every key of the warp after every query: nothing to add (and dS
      // is 0 there).
      if (warp_key0 > s0 + kStep - 1) {
        if constexpr (kStoreDs) {
          StoreDs<Op, kStep / 8>(ds_row, step * kStep, nullptr, true);
        }
        continue;
      }
      const E* q_rows = q_tiles[qt & 1] + step * kStep * Op::kLd;
      const E* do_rows = do_tiles[qt & 1] + step * kStep * Op::kLd;
      const float* lse_sub = lse_tiles[qt & 1] + step * kStep;
      const float* delta_sub = delta_tiles[qt & 1] + step * kStep;
      // Below the diagonal every key precedes every query; a padded query
      // (>= T) gets 0 from its infinite lse.
      const bool masked = warp_last > s0 || warp_last >= T;
      // P^T (16 kM keys x kStep queries).
      float p[kM][kStep / 8][4];
      ProductWithRows<Op, kM, kStep / 8>(p, ka, q_rows, lane);
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int j = 0; j < kStep / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            p[m][j][e] = Exp2(fmaf(p[m][j][e], scale_log2, -lse_sub[8 * j + 2 * q + (e & 1)]));
      if (masked) MaskAfterDiagonal<kM, kStep / 8, true>(p, warp_key0, s0, T, 0.0f, g, q);
      // dV (16 kM keys x 64 dims) += P^T @ dO.
      AccumulateProduct<Op, kM, kStep / 8>(dv, p, do_rows, lane);
      // dP^T (16 kM keys x kStep queries) = V @ dO^T; then dS^T / scale =
      // P^T (dP^T - delta), in place. The scale (1/8 for head size 64)
      // multiplies dK once, when it is stored: a power of two, so the
      // same bits as scaling every dS, for a multiply a score less.
      float ds[kM][kStep / 8][4];
      if constexpr (kValuesInRegisters) {
        ProductWithRows<Op, kM, kStep / 8>(ds, va, do_rows, lane);
      } else {
        ProductWithRowsShared<Op, kM, kStep / 8>(ds, v_tile, kWarpRows * warp, do_rows, lane);
      }
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int j = 0; j < kStep / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int query_index = 8 * j + 2 * q + (e & 1);
            ds[m][j][e] = p[m][j][e] * (ds[m][j][e] - delta_sub[query_index]);
          }
        }
      }
      if constexpr (kStoreDs) {
        StoreDs<Op, kStep / 8>(ds_row, step * kStep, ds[0], false);
      }
      // dK (16 kM keys x 64 dims) += dS^T @ Q.
      AccumulateProduct<Op, kM, kStep / 8>(dk, ds, q_rows, lane);
    }
    __syncthreads();  // done with this buffer before it is refilled
  }
  E* dseq = dqkv + static_cast<size_t>(b) * T * stride + h * kHs;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    StoreRows<Op>(dseq + C, stride, warp_key0 + 16 * m, T, dk[m], scale, g, q);
    StoreRows<Op>(dseq + 2 * C, stride, warp_key0 + 16 * m, T, dv[m], 1.0f, g, q);
  }
}

// dQ: block = 64 kM queries of one (b, h); loops over the key tiles at
// and below the diagonal, kStep keys at a time.
template <class Op, int kM, int kStep, int kMinBlocks, typename E = typename Op::T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    QueryKernel(E* dqkv, const E* dout, const E* qkv, const float* lse, const float* delta, int T,
                int C, int NH, float scale, float scale_log2) {
  E(*k_tiles)[kTile * Op::kLd];
  E(*v_tiles)[kTile * Op::kLd];
  KeyValueBuffers<Op>(&k_tiles, &v_tiles);
  constexpr int kWarpRows = 16 * kM, kBlockRows = kWarps * kWarpRows;
  const int blocks = (T + kBlockRows - 1) / kBlockRows;
  const int qb = blocks - 1 - blockIdx.x;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const E* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const E* dout_seq = dout + static_cast<size_t>(b) * T * C + h * kHs;
  const int q0 = qb * kBlockRows;
  const int warp_row0 = q0 + kWarpRows * warp, warp_last = warp_row0 + kWarpRows - 1;

  Frag qa[kM][kHs / Op::kK], da[kM][kHs / Op::kK];
  // This block's queries and their dout pass through the key and value
  // buffers first (each pair contiguous: 128 rows).
  LoadTile<Op, kBlockRows>(&k_tiles[0][0], seq, stride, q0, T);
  LoadTile<Op, kBlockRows>(&v_tiles[0][0], dout_seq, C, q0, T);
  __syncthreads();
  LoadRowFragments<Op, kM>(qa, &k_tiles[0][0], kWarpRows * warp, g, q);
  LoadRowFragments<Op, kM>(da, &v_tiles[0][0], kWarpRows * warp, g, q);
  __syncthreads();
  float row_lse[kM][2], row_delta[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + 16 * m + g + 8 * half;
      const bool valid = row < T;
      row_lse[m][half] = valid ? lse[static_cast<size_t>(bh) * T + row] : INFINITY;
      row_delta[m][half] = valid ? delta[static_cast<size_t>(bh) * T + row] : 0.0f;
    }
  }

  float dq[kM][kHs / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) Zero<kHs / 8>(dq[m]);
  const int last = min(q0 + kBlockRows - 1, T - 1) / kTile;
  LoadKeyValuesAsync<Op>(k_tiles[0], v_tiles[0], seq, stride, C, 0, T);
  for (int kt = 0; kt <= last; ++kt) {
    NextKeyValueTile<Op>(k_tiles, v_tiles, seq, stride, C, kt, last, T);
#pragma unroll
    for (int step = 0; step < kTile / kStep; ++step) {
      const int s0 = kt * kTile + step * kStep;  // the first key of this step
      if (s0 > warp_last) continue;              // after every row of the warp
      const E* k_rows = k_tiles[kt & 1] + step * kStep * Op::kLd;
      const E* v_rows = v_tiles[kt & 1] + step * kStep * Op::kLd;
      // Below the diagonal every key precedes every row, and is < T.
      const bool masked = s0 + kStep - 1 > warp_row0 || s0 + kStep > T;
      float p[kM][kStep / 8][4], ds[kM][kStep / 8][4];
      ProductWithRows<Op, kM, kStep / 8>(p, qa, k_rows, lane);   // S = Q K^T
      ProductWithRows<Op, kM, kStep / 8>(ds, da, v_rows, lane);  // dP = dO V^T
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int j = 0; j < kStep / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            p[m][j][e] = Exp2(fmaf(p[m][j][e], scale_log2, -row_lse[m][e >> 1]));
      if (masked) MaskAfterDiagonal<kM, kStep / 8, false>(p, warp_row0, s0, T, 0.0f, g, q);
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int j = 0; j < kStep / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ds[m][j][e] = p[m][j][e] * (ds[m][j][e] - row_delta[m][e >> 1]);
      // dQ += (dS / scale) @ K; the scale is applied when dQ is stored,
      // as for dK above.
      AccumulateProduct<Op, kM, kStep / 8>(dq, ds, k_rows, lane);
    }
    __syncthreads();  // done with this buffer before it is refilled
  }
  E* dseq = dqkv + static_cast<size_t>(b) * T * stride + h * kHs;
#pragma unroll
  for (int m = 0; m < kM; ++m)
    StoreRows<Op>(dseq, stride, warp_row0 + 16 * m, T, dq[m], scale, g, q);
}

// dQ from the stored dS (FlashTiling::stored_ds, bf16): block = 64 kM
// queries of one (b, h), kM query tiles; for each key tile up to the
// block's last query tile, dQ (16 kM rows a warp x 64 dims) += dS (rows x
// 64 keys) @ K, 16 keys (a k-chunk) at a time. The dS tiles are [key]
// [query], so their A fragments are read transposed. Shared memory
// (dynamic): two buffers each of the key tile and of the block's kM dS
// tiles.
template <int kM>
__host__ __device__ constexpr size_t StoredQuerySharedBytes() {
  return 2 * (1 + kM) * kTile * Bf16Mma::kLd * sizeof(bf16);
}
template <int kM, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    StoredQueryKernel(bf16* dqkv, const bf16* ds_store, const bf16* qkv, int T, int C, int NH,
                      float scale) {
  using Op = Bf16Mma;
  MUSTER_DYNAMIC_SHARED(shared);
  auto k_tiles = reinterpret_cast<bf16(*)[kTile * Op::kLd]>(shared);
  auto ds_tiles = reinterpret_cast<bf16(*)[kM][kTile * Op::kLd]>(k_tiles + 2);
  constexpr int kWarpRows = 16 * kM, kBlockRows = kWarps * kWarpRows;
  const int tiles = (T + kTile - 1) / kTile;
  const int blocks = (T + kBlockRows - 1) / kBlockRows;
  const int qb = blocks - 1 - blockIdx.x;  // longest rows first
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const int q0 = qb * kBlockRows, first_tile = q0 / kTile;
  const int warp_row0 = q0 + kWarpRows * warp, warp_last = warp_row0 + kWarpRows - 1;
  // The warp's query tile, which of the block's it is, and the warp's
  // columns in it.
  const int warp_tile = warp_row0 / kTile, warp_slot = warp_tile - first_tile;
  const int warp_col0 = warp_row0 % kTile;

  // Copies in key tile kt and the block's dS tiles for it (those at or
  // below the diagonal, of query tiles that exist) to buffer `buffer`.
  auto load = [&](int kt, int buffer) {
    LoadTileAsync<Op>(k_tiles[buffer], seq + C, stride, kt * kTile, T);
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      const int qt = first_tile + i;
      if (kt <= qt && qt < tiles) {
        LoadTileAsync<Op>(ds_tiles[buffer][i], ds_store + DsTileOffset(bh, tiles, qt, kt), kTile, 0,
                          kTile);
      }
    }
    CommitTiles();
  };
  float dq[kM][kHs / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) Zero<kHs / 8>(dq[m]);
  const int last = min(q0 + kBlockRows - 1, T - 1) / kTile;
  load(0, 0);
  for (int kt = 0; kt <= last; ++kt) {
    if (kt < last) {
      load(kt + 1, (kt + 1) & 1);
      WaitTiles<1>();
    } else {
      WaitTiles<0>();
    }
    __syncthreads();  // tile kt has landed for every thread
    if (kt <= warp_tile && warp_row0 < T) {
      const bf16* ds_tile = ds_tiles[kt & 1][warp_slot];
      const bf16* k_rows = k_tiles[kt & 1];
#pragma unroll
      for (int kc = 0; kc < kTile / Op::kK; ++kc) {
        // Keys after every row of the warp: dS is 0 there.
        if (kt * kTile + Op::kK * kc > warp_last) break;
        Frag a[kM];
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          a[m] = Op::LoadATransposed(ds_tile, warp_col0 + 16 * m, Op::kK * kc, lane);
        }
        AccumulateChunk<Op, kM>(dq, a, k_rows, Op::kK * kc, lane);
      }
    }
    __syncthreads();  // done with this buffer before it is refilled
  }
  bf16* dseq = dqkv + static_cast<size_t>(b) * T * stride + h * kHs;
#pragma unroll
  for (int m = 0; m < kM; ++m)
    StoreRows<Op>(dseq, stride, warp_row0 + 16 * m, T, dq[m], scale, g, q);
}

}  // namespace

namespace {

// Launches kKernel; for more than 48 KB of dynamic shared memory, that
// amount must be allowed first, once per device (it stays set), so a
// launch captured into a CUDA graph finds it set by the eager one before
// (the model's graphs, worker/model/model_cuda.cc). A failure shows as the
// launch's error. Each kernel is always launched with the same amount.
template <auto kKernel, typename... Args>
void Launch(dim3 grid, size_t shared_bytes, cudaStream_t stream, Args... args) {
#ifndef MUSTER_SIMT
  if (shared_bytes > 48 * 1024) {
    static std::atomic<uint64_t> allowed{0};  // a bit per device (past 63: every time)
    int device = 0;
    cudaGetDevice(&device);
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if ((allowed.load(std::memory_order_acquire) & bit) == 0 &&
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(shared_bytes)) == cudaSuccess) {
      allowed.fetch_or(bit, std::memory_order_acq_rel);
    }
  }
#endif
  LaunchKernel<kKernel>(grid, kThreads, shared_bytes, stream, args...);
}

// Dynamic shared memory of the forward and dQ kernels: none where their
// buffers are static (KeyValueBuffers).
template <class Op>
constexpr size_t DynamicTileBytes() {
  return TileBuffersBytes<Op>() <= 48 * 1024 ? 0 : TileBuffersBytes<Op>();
}

template <class Op, int kM, int kStep, int kMinBlocks>
void LaunchForward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH,
                   cudaStream_t stream) {
  using E = typename Op::T;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(kHs));
  const dim3 grid(CeilDiv(T, kWarps * 16 * kM), B * NH);
  Launch<ForwardKernel<Op, kM, kStep, kMinBlocks>>(
      grid, DynamicTileBytes<Op>(), stream, static_cast<E*>(out), lse, static_cast<const E*>(qkv),
      T, C, NH, scale_log2);
}

template <class Op, int kM, int kStep, bool kValuesInRegisters, int kMinBlocks, bool kStoreDs>
void LaunchKeyValue(void* dqkv, const void* dout, const void* qkv, const float* lse,
                    const float* delta, void* ds, int B, int T, int C, int NH,
                    cudaStream_t stream) {
  using E = typename Op::T;
  const float scale = 1.0f / sqrtf(static_cast<float>(kHs));
  const dim3 grid(CeilDiv(T, kWarps * 16 * kM), B * NH);
  Launch<KeyValueKernel<Op, kM, kStep, kValuesInRegisters, kMinBlocks, kStoreDs>>(
      grid, KeyValueSharedBytes<Op>(kM), stream, static_cast<E*>(dqkv), static_cast<const E*>(dout),
      static_cast<const E*>(qkv), lse, delta, static_cast<E*>(ds), T, C, NH, scale, kLog2e * scale);
}

template <class Op, int kM, int kStep, int kMinBlocks>
void LaunchQuery(void* dqkv, const void* dout, const void* qkv, const float* lse,
                 const float* delta, void* /*ds*/, int B, int T, int C, int NH,
                 cudaStream_t stream) {
  using E = typename Op::T;
  const float scale = 1.0f / sqrtf(static_cast<float>(kHs));
  const dim3 grid(CeilDiv(T, kWarps * 16 * kM), B * NH);
  Launch<QueryKernel<Op, kM, kStep, kMinBlocks>>(
      grid, DynamicTileBytes<Op>(), stream, static_cast<E*>(dqkv), static_cast<const E*>(dout),
      static_cast<const E*>(qkv), lse, delta, T, C, NH, scale, kLog2e * scale);
}

template <int kM, int kMinBlocks>
void LaunchStoredQuery(void* dqkv, const void* /*dout*/, const void* qkv, const float* /*lse*/,
                       const float* /*delta*/, void* ds, int B, int T, int C, int NH,
                       cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(kHs));
  const dim3 grid(CeilDiv(T, kWarps * 16 * kM), B * NH);
  Launch<StoredQueryKernel<kM, kMinBlocks>>(grid, StoredQuerySharedBytes<kM>(), stream,
                                            static_cast<bf16*>(dqkv), static_cast<const bf16*>(ds),
                                            static_cast<const bf16*>(qkv), T, C, NH, scale);
}

template <class Op>
void LaunchDelta(float* delta, const void* dout, const void* out, int B, int T, int C, int NH,
                 cudaStream_t stream) {
  using E = typename Op::T;
  const size_t rows = static_cast<size_t>(B) * NH * T;
  Launch<DeltaKernel<E>>(dim3(CeilDiv(rows, kWarps)), 0, stream, delta, static_cast<const E*>(dout),
                         static_cast<const E*>(out), B, T, C, NH);
}

using ForwardLaunch = void (*)(void*, float*, const void*, int, int, int, int, cudaStream_t);
using BackwardLaunch = void (*)(void*, const void*, const void*, const float*, const float*, void*,
                                int, int, int, int, cudaStream_t);

// The tilings that are compiled (flash_attention.h); nullptr for any other.
ForwardLaunch ForwardFor(FlashMath math, const FlashKernelTiling& t) {
  const int r = t.rows, s = t.step, n = t.blocks_per_sm;
  if (math == FlashMath::kTf32) {
    if (r == 16 && s == 64 && n == 0) return LaunchForward<Tf32Mma, 1, 64, 0>;
    if (r == 16 && s == 32 && n == 0) return LaunchForward<Tf32Mma, 1, 32, 0>;
    if (r == 32 && s == 32 && n == 0) return LaunchForward<Tf32Mma, 2, 32, 0>;
    return nullptr;
  }
  if (r == 32 && s == 64 && n == 0) return LaunchForward<Bf16Mma, 2, 64, 0>;
  if (r == 32 && s == 32 && n == 0) return LaunchForward<Bf16Mma, 2, 32, 0>;
  if (r == 16 && s == 64 && n == 0) return LaunchForward<Bf16Mma, 1, 64, 0>;
  if (r == 16 && s == 32 && n == 0) return LaunchForward<Bf16Mma, 1, 32, 0>;
  return nullptr;
}
BackwardLaunch KeyValueFor(FlashMath math, const FlashKernelTiling& t, bool stored_ds) {
  const int r = t.rows, s = t.step, n = t.blocks_per_sm;
  const bool v = t.values_in_registers;
  if (math == FlashMath::kTf32) {
    if (stored_ds) return nullptr;
    if (r == 16 && s == 32 && !v && n == 0) return LaunchKeyValue<Tf32Mma, 1, 32, false, 0, false>;
    if (r == 16 && s == 16 && !v && n == 0) return LaunchKeyValue<Tf32Mma, 1, 16, false, 0, false>;
    if (r == 32 && s == 16 && !v && n == 0) return LaunchKeyValue<Tf32Mma, 2, 16, false, 0, false>;
    return nullptr;
  }
  if (stored_ds) {
    if (r == 16 && s == 32 && v && n == 3) return LaunchKeyValue<Bf16Mma, 1, 32, true, 3, true>;
    if (r == 16 && s == 32 && !v && n == 0) return LaunchKeyValue<Bf16Mma, 1, 32, false, 0, true>;
    return nullptr;
  }
  if (r == 16 && s == 32 && v && n == 0) return LaunchKeyValue<Bf16Mma, 1, 32, true, 0, false>;
  if (r == 16 && s == 32 && !v && n == 0) return LaunchKeyValue<Bf16Mma, 1, 32, false, 0, false>;
  if (r == 16 && s == 64 && v && n == 0) return LaunchKeyValue<Bf16Mma, 1, 64, true, 0, false>;
  if (r == 16 && s == 64 && !v && n == 0) return LaunchKeyValue<Bf16Mma, 1, 64, false, 0, false>;
  if (r == 16 && s == 16 && !v && n == 4) return LaunchKeyValue<Bf16Mma, 1, 16, false, 4, false>;
  if (r == 32 && s == 32 && !v && n == 0) return LaunchKeyValue<Bf16Mma, 2, 32, false, 0, false>;
  return nullptr;
}
BackwardLaunch QueryFor(FlashMath math, const FlashKernelTiling& t, bool stored_ds) {
  const int r = t.rows, s = t.step, n = t.blocks_per_sm;
  if (stored_ds) {
    if (math != FlashMath::kBf16 || t.values_in_registers || s != 64 || n != 0) return nullptr;
    if (r == 16) return LaunchStoredQuery<1, 0>;
    if (r == 32) return LaunchStoredQuery<2, 0>;
    return nullptr;
  }
  if (math == FlashMath::kTf32) {
    if (r == 16 && s == 32 && n == 0) return LaunchQuery<Tf32Mma, 1, 32, 0>;
    if (r == 16 && s == 16 && n == 0) return LaunchQuery<Tf32Mma, 1, 16, 0>;
    return nullptr;
  }
  if (r == 16 && s == 64 && n == 0) return LaunchQuery<Bf16Mma, 1, 64, 0>;
  if (r == 16 && s == 32 && n == 0) return LaunchQuery<Bf16Mma, 1, 32, 0>;
  if (r == 16 && s == 16 && n == 4) return LaunchQuery<Bf16Mma, 1, 16, 4>;
  if (r == 32 && s == 32 && n == 0) return LaunchQuery<Bf16Mma, 2, 32, 0>;
  return nullptr;
}

// The scratch's parts: delta, then (stored_ds) the dS tiles, 16-byte
// aligned.
size_t DeltaFloats(int B, int T, int NH) { return (static_cast<size_t>(B) * NH * T + 3) / 4 * 4; }

}  // namespace

FlashTiling FlashDefaultTiling(FlashMath math) {
  if (math == FlashMath::kBf16) return FlashTiling{};
  FlashTiling tiling;
  tiling.forward = {32, 32, false, 0};
  tiling.key_value = {32, 16, false, 0};
  tiling.query = {16, 32, false, 0};
  tiling.stored_ds = false;  // bf16 only
  return tiling;
}

int FlashAttentionForward(FlashMath math, void* out, float* lse, const void* qkv, int B, int T,
                          int C, int NH, void* stream, const FlashTiling& tiling) {
  const ForwardLaunch launch = ForwardFor(math, tiling.forward);
  if (launch == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (B == 0 || T == 0) return 0;
  launch(out, lse, qkv, B, T, C, NH, AsStream(stream));
  return LaunchStatus();
}

size_t FlashAttentionBackwardScratchFloats(FlashMath math, int B, int T, int NH,
                                           const FlashTiling& tiling) {
  if (KeyValueFor(math, tiling.key_value, tiling.stored_ds) == nullptr ||
      QueryFor(math, tiling.query, tiling.stored_ds) == nullptr) {
    return 0;
  }
  size_t floats = DeltaFloats(B, T, NH);
  if (tiling.stored_ds) {
    const int tiles = CeilDiv(T, kTile);
    floats += static_cast<size_t>(B) * NH * CausalTiles(tiles) * kTile * kTile * sizeof(bf16) /
              sizeof(float);
  }
  return floats;
}

size_t FlashAttentionBackwardScratchFloats(FlashMath math, int B, int T, int NH) {
  return FlashAttentionBackwardScratchFloats(math, B, T, NH, FlashDefaultTiling(math));
}

int FlashAttentionBackward(FlashMath math, void* dqkv, float* scratch, const void* dout,
                           const void* out, const void* qkv, const float* lse, int B, int T, int C,
                           int NH, void* stream, const FlashTiling& tiling) {
  const BackwardLaunch key_value = KeyValueFor(math, tiling.key_value, tiling.stored_ds);
  const BackwardLaunch query = QueryFor(math, tiling.query, tiling.stored_ds);
  if (key_value == nullptr || query == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if (B == 0 || T == 0) return 0;
  const cudaStream_t s = AsStream(stream);
  float* delta = scratch;
  void* ds = tiling.stored_ds ? scratch + DeltaFloats(B, T, NH) : nullptr;
  if (math == FlashMath::kTf32) {
    LaunchDelta<Tf32Mma>(delta, dout, out, B, T, C, NH, s);
  } else {
    LaunchDelta<Bf16Mma>(delta, dout, out, B, T, C, NH, s);
  }
  int status = LaunchStatus();
  if (status != 0) return status;
  key_value(dqkv, dout, qkv, lse, delta, ds, B, T, C, NH, s);
  status = LaunchStatus();
  if (status != 0) return status;
  query(dqkv, dout, qkv, lse, delta, ds, B, T, C, NH, s);
  return LaunchStatus();
}

int FlashAttentionForward(FlashMath math, void* out, float* lse, const void* qkv, int B, int T,
                          int C, int NH, void* stream) {
  return FlashAttentionForward(math, out, lse, qkv, B, T, C, NH, stream, FlashDefaultTiling(math));
}

int FlashAttentionBackward(FlashMath math, void* dqkv, float* scratch, const void* dout,
                           const void* out, const void* qkv, const float* lse, int B, int T, int C,
                           int NH, void* stream) {
  return FlashAttentionBackward(math, dqkv, scratch, dout, out, qkv, lse, B, T, C, NH, stream,
                                FlashDefaultTiling(math));
}

}  // namespace muster::kernels::fast
