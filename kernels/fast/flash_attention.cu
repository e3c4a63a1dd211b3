// Flash attention forward and backward (flash_attention.h) on mma.sync.
//
// A block is 4 warps; each warp owns 16 rows of a 64-row tile. Fragments
// of m16n8k16 (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and
// q = lane % 4:
//   A (16 x 16, row-major): a0 (g, 2q..2q+1), a1 (g+8, 2q..), a2 (g, 2q+8..),
//                           a3 (g+8, 2q+8..)
//   B (16 x 8):             b0 (k = 2q..2q+1, n = g), b1 (k = 2q+8.., n = g)
//   C (16 x 8, fp32):       c0 c1 (g, 2q..2q+1), c2 c3 (g+8, 2q..2q+1)
// An accumulator tile pair (n-tiles 2j, 2j+1) is exactly the A fragment of
// the next product's k-chunk j, so probabilities go from one product to
// the next in registers.
//
// Tiles are staged in shared memory as [row][64 dims] with rows padded to
// 72 elements (144 bytes), so the 8 rows an ldmatrix phase reads fall in
// different banks.
#include <cmath>
#include <cstdint>

#include "kernels/fast/common.cuh"
#include "kernels/fast/flash_attention.h"

namespace muster::kernels::fast {
namespace {

constexpr int kTile = 64;  // rows of a tile (queries or keys)
constexpr int kHs = kFlashHeadSize;
constexpr int kLd = kHs + 8;  // padded row, in bf16 elements
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

struct Frag {
  uint32_t r[4];
};

__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t Load32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// A fragment (rows row0.., k-chunk kc) of a row-major [row][dim] tile.
__device__ __forceinline__ Frag LoadA(const bf16* tile, int row0, int kc, int g, int q) {
  const bf16* top = tile + (row0 + g) * kLd + 16 * kc + 2 * q;
  const bf16* bottom = top + 8 * kLd;
  return Frag{{Load32(top), Load32(bottom), Load32(top + 8), Load32(bottom + 8)}};
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
__device__ __forceinline__ void LoadBContiguousPair(const bf16* tile, int n0, int k0, int lane,
                                                    uint32_t* b) {
  const int matrix = lane / 8, row = lane % 8;
  const bf16* p = tile + (n0 + 8 * (matrix >> 1) + row) * kLd + k0 + 8 * (matrix & 1);
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(address));
}
__device__ __forceinline__ void LoadBStridedPair(const bf16* tile, int n0, int k0, int lane,
                                                 uint32_t* b) {
  const int matrix = lane / 8, row = lane % 8;
  const bf16* p = tile + (k0 + 8 * (matrix & 1) + row) * kLd + n0 + 8 * (matrix >> 1);
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(address));
}
// The A fragment of k-chunk j from accumulator n-tiles 2j and 2j+1.
__device__ __forceinline__ Frag AccToA(const float (*acc)[4], int j) {
  return Frag{{Pack2(acc[2 * j][0], acc[2 * j][1]), Pack2(acc[2 * j][2], acc[2 * j][3]),
               Pack2(acc[2 * j + 1][0], acc[2 * j + 1][1]),
               Pack2(acc[2 * j + 1][2], acc[2 * j + 1][3])}};
}

// Copies rows [row0, row0 + 64) of one head's slice (64 dims at `base`,
// rows `row_stride` elements apart) into a padded tile; rows >= T are 0.
__device__ __forceinline__ void LoadTile(bf16* tile, const bf16* base, size_t row_stride, int row0,
                                         int T) {
  for (int i = threadIdx.x; i < kTile * (kHs / 8); i += kThreads) {
    const int r = i / (kHs / 8), c = (i % (kHs / 8)) * 8;
    Pack<bf16> v;
    if (row0 + r < T) {
      v = LoadPack(base + (row0 + r) * row_stride + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v.v[e] = __float2bfloat16_rn(0.0f);
    }
    StorePack(tile + r * kLd + c, v);
  }
}

// LoadTile with cp.async: the copies land in shared memory in the
// background; rows >= T are zero-filled (a source size of 0). The caller
// commits the group and waits for it (WaitTiles) before reading.
__device__ __forceinline__ void LoadTileAsync(bf16* tile, const bf16* base, size_t row_stride,
                                              int row0, int T) {
  for (int i = threadIdx.x; i < kTile * (kHs / 8); i += kThreads) {
    const int r = i / (kHs / 8), c = (i % (kHs / 8)) * 8;
    const bool valid = row0 + r < T;
    const bf16* source = valid ? base + (row0 + r) * row_stride + c : base;
    const uint32_t destination =
        static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * kLd + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source),
                 "r"(valid ? 16 : 0));
  }
}
__device__ __forceinline__ void CommitTiles() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `pending` committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void WaitTiles() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// Starts copying the keys and values of rows [row0, row0 + 64) of a
// sequence's qkv (`seq` at this head's q) into k_tile and v_tile, as one
// group.
__device__ __forceinline__ void LoadKeyValuesAsync(bf16* k_tile, bf16* v_tile, const bf16* seq,
                                                   size_t stride, int C, int row0, int T) {
  LoadTileAsync(k_tile, seq + C, stride, row0, T);
  LoadTileAsync(v_tile, seq + 2 * C, stride, row0, T);
  CommitTiles();
}

// Iteration kt of a loop over key tiles 0..last, each ending with a
// barrier: starts copying tile kt + 1 into the other buffer (last read in
// iteration kt - 1), then waits until tile kt has landed for every thread.
__device__ __forceinline__ void NextKeyValueTile(bf16 (*k_tiles)[kTile * kLd],
                                                 bf16 (*v_tiles)[kTile * kLd], const bf16* seq,
                                                 size_t stride, int C, int kt, int last, int T) {
  if (kt < last) {
    LoadKeyValuesAsync(k_tiles[(kt + 1) & 1], v_tiles[(kt + 1) & 1], seq, stride, C,
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

// S (16 x 64) = A-rows (4 k-chunks in registers) @ tile^T, for a tile of
// 64 rows read as B[k = dim][n = row].
__device__ __forceinline__ void ProductWithRows(float (*s)[4], const Frag* a, const bf16* tile,
                                                int lane) {
  Zero<8>(s);
#pragma unroll
  for (int kc = 0; kc < kHs / 16; ++kc) {
#pragma unroll
    for (int j = 0; j < kTile / 8; j += 2) {
      uint32_t b[4];
      LoadBContiguousPair(tile, 8 * j, 16 * kc, lane, b);
      Mma(s[j], a[kc].r, b[0], b[1]);
      Mma(s[j + 1], a[kc].r, b[2], b[3]);
    }
  }
}

// acc (16 x 64 dims) += P (16 x 64, accumulator layout) @ tile (64 rows x
// 64 dims), tile read as B[k = row][n = dim].
__device__ __forceinline__ void AccumulateProduct(float (*acc)[4], const float (*p)[4],
                                                  const bf16* tile, int lane) {
#pragma unroll
  for (int kc = 0; kc < kTile / 16; ++kc) {
    const Frag a = AccToA(p, kc);
#pragma unroll
    for (int j = 0; j < kHs / 8; j += 2) {
      uint32_t b[4];
      LoadBStridedPair(tile, 8 * j, 16 * kc, lane, b);
      Mma(acc[j], a.r, b[0], b[1]);
      Mma(acc[j + 1], a.r, b[2], b[3]);
    }
  }
}

// Writes a warp's 16 x 64 accumulator (times `scale`) as bf16 rows at
// `base` + row * row_stride, for rows < T.
__device__ __forceinline__ void StoreRows(bf16* base, size_t row_stride, int row0, int T,
                                          const float (*acc)[4], float scale, int g, int q) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= T) continue;
    bf16* out = base + row * row_stride;
#pragma unroll
    for (int j = 0; j < kHs / 8; ++j) {
      *reinterpret_cast<uint32_t*>(out + 8 * j + 2 * q) =
          Pack2(acc[j][2 * half] * scale, acc[j][2 * half + 1] * scale);
    }
  }
}

// ---- forward: block = 64 queries of one (b, h) ----
__global__ void __launch_bounds__(kThreads)
    ForwardKernel(bf16* out, float* lse, const bf16* qkv, int T, int C, int NH, float scale_log2) {
  __shared__ __align__(16) bf16 q_tile[kTile * kLd];
  // Two buffers: tile kt + 1 is copied in while tile kt is used.
  __shared__ __align__(16) bf16 k_tiles[2][kTile * kLd];
  __shared__ __align__(16) bf16 v_tiles[2][kTile * kLd];
  const int tiles = (T + kTile - 1) / kTile;
  const int qt = tiles - 1 - blockIdx.x;  // longest rows first
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const int q0 = qt * kTile;

  LoadTile(q_tile, seq, stride, q0, T);
  __syncthreads();
  Frag qa[kHs / 16];
#pragma unroll
  for (int kc = 0; kc < kHs / 16; ++kc) qa[kc] = LoadA(q_tile, 16 * warp, kc, g, q);

  float o[kHs / 8][4];
  Zero<kHs / 8>(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int row[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};
  LoadKeyValuesAsync(k_tiles[0], v_tiles[0], seq, stride, C, 0, T);
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    NextKeyValueTile(k_tiles, v_tiles, seq, stride, C, kt, qt, T);
    const bf16* k_tile = k_tiles[kt & 1];
    const bf16* v_tile = v_tiles[kt & 1];
    const bool diagonal = kt == qt;
    float s[kTile / 8][4];
    ProductWithRows(s, qa, k_tile, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = k0 + 8 * j + 2 * q + e;
          float& x = s[j][2 * half + e];
          // Only the diagonal tile has keys after a row (or past T).
          x = (!diagonal || (key <= row[half] && key < T)) ? x * scale_log2 : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // Key 0 is in the first tile of every row, so the max is finite
      // from the first tile on.
      const float m_new = fmaxf(m[half], tile_max);
      const float correction = exp2f(m[half] - m_new);
      m[half] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * half + e];
          x = exp2f(x - m_new);
          sum += x;
        }
      }
      l[half] = l[half] * correction + sum;
#pragma unroll
      for (int j = 0; j < kHs / 8; ++j) {
        o[j][2 * half] *= correction;
        o[j][2 * half + 1] *= correction;
      }
    }
    AccumulateProduct(o, s, v_tile, lane);
    __syncthreads();  // done with this buffer before it is refilled
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
  bf16* out_seq = out + static_cast<size_t>(b) * T * C + h * kHs;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row[half];
    if (r >= T) continue;
    const float inv = 1.0f / l[half];
#pragma unroll
    for (int j = 0; j < kHs / 8; ++j) {
      *reinterpret_cast<uint32_t*>(out_seq + static_cast<size_t>(r) * C + 8 * j + 2 * q) =
          Pack2(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
    }
    if (q == 0) lse[static_cast<size_t>(bh) * T + r] = m[half] + log2f(l[half]);
  }
}

// ---- backward ----
// delta[row] = sum_d dout[row, d] * out[row, d], per (b, h, t): one warp
// per row, 2 dims per lane.
__global__ void DeltaKernel(float* delta, const bf16* dout, const bf16* out, int B, int T, int C,
                            int NH) {
  const size_t row = blockIdx.x * static_cast<size_t>(kWarps) + threadIdx.x / 32;
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const int lane = threadIdx.x % 32;
  const int t = static_cast<int>(row % T), h = static_cast<int>(row / T % NH);
  const int b = static_cast<int>(row / T / NH);
  const size_t offset = (static_cast<size_t>(b) * T + t) * C + h * kHs + 2 * lane;
  const float sum = __bfloat162float(dout[offset]) * __bfloat162float(out[offset]) +
                    __bfloat162float(dout[offset + 1]) * __bfloat162float(out[offset + 1]);
  const float total = WarpSum(sum);
  if (lane == 0) delta[row] = total;
}

// dK and dV: block = 64 keys of one (b, h); loops over the query tiles at
// and below the diagonal. Works with transposed scores: S^T = K Q^T.
__global__ void __launch_bounds__(kThreads)
    KeyValueKernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                   const float* delta, int T, int C, int NH, float scale, float scale_log2) {
  // Two buffers of each per-query tile: tile qt + 1 is copied in while
  // tile qt is used.
  __shared__ __align__(16) bf16 q_tiles[2][kTile * kLd];
  __shared__ __align__(16) bf16 do_tiles[2][kTile * kLd];
  __shared__ __align__(16) bf16 kv_tile[kTile * kLd];
  __shared__ float lse_tiles[2][kTile], delta_tiles[2][kTile];
  const int tiles = (T + kTile - 1) / kTile;
  const int kt = blockIdx.x;  // the first key tiles see the most queries
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const bf16* dout_seq = dout + static_cast<size_t>(b) * T * C + h * kHs;
  const int k0 = kt * kTile;

  Frag ka[kHs / 16], va[kHs / 16];
  LoadTile(kv_tile, seq + C, stride, k0, T);
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < kHs / 16; ++kc) ka[kc] = LoadA(kv_tile, 16 * warp, kc, g, q);
  __syncthreads();
  LoadTile(kv_tile, seq + 2 * C, stride, k0, T);
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < kHs / 16; ++kc) va[kc] = LoadA(kv_tile, 16 * warp, kc, g, q);

  float dk[kHs / 8][4], dv[kHs / 8][4];
  Zero<kHs / 8>(dk);
  Zero<kHs / 8>(dv);
  const int key[2] = {k0 + 16 * warp + g, k0 + 16 * warp + g + 8};
  // Copies in query tile `tile` (rows, dout, lse, delta) to buffer `buffer`.
  auto load_queries = [&](int tile, int buffer) {
    const int first = tile * kTile;
    LoadTileAsync(q_tiles[buffer], seq, stride, first, T);
    LoadTileAsync(do_tiles[buffer], dout_seq, C, first, T);
    CommitTiles();
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool valid = first + i < T;
      // A padded query row gets probability 0 (exp2(-inf)) and no delta.
      lse_tiles[buffer][i] = valid ? lse[static_cast<size_t>(bh) * T + first + i] : INFINITY;
      delta_tiles[buffer][i] = valid ? delta[static_cast<size_t>(bh) * T + first + i] : 0.0f;
    }
  };
  load_queries(kt, kt & 1);
  for (int qt = kt; qt < tiles; ++qt) {
    const int q0 = qt * kTile;
    if (qt + 1 < tiles) {
      load_queries(qt + 1, (qt + 1) & 1);
      WaitTiles<1>();
    } else {
      WaitTiles<0>();
    }
    __syncthreads();  // tile qt has landed for every thread
    const bf16* q_tile = q_tiles[qt & 1];
    const bf16* do_tile = do_tiles[qt & 1];
    const float* lse_tile = lse_tiles[qt & 1];
    const float* delta_tile = delta_tiles[qt & 1];
    const bool diagonal = qt == kt;
    // P^T (16 keys x 64 queries).
    float p[kTile / 8][4];
    ProductWithRows(p, ka, q_tile, lane);
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query_index = 8 * j + 2 * q + (e & 1);
        const int query = q0 + query_index;
        // Below the diagonal every key precedes every query; a padded
        // query (>= T) gets 0 from its infinite lse.
        const bool visible = !diagonal || (key[e >> 1] <= query && key[e >> 1] < T);
        p[j][e] = visible ? exp2f(p[j][e] * scale_log2 - lse_tile[query_index]) : 0.0f;
      }
    }
    // dV (16 keys x 64 dims) += P^T @ dO.
    AccumulateProduct(dv, p, do_tile, lane);
    // dP^T (16 keys x 64 queries) = V @ dO^T; then dS^T = P^T (dP^T -
    // delta) * scale, in place.
    float ds[kTile / 8][4];
    ProductWithRows(ds, va, do_tile, lane);
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query_index = 8 * j + 2 * q + (e & 1);
        ds[j][e] = p[j][e] * (ds[j][e] - delta_tile[query_index]) * scale;
      }
    }
    // dK (16 keys x 64 dims) += dS^T @ Q.
    AccumulateProduct(dk, ds, q_tile, lane);
    __syncthreads();  // done with this buffer before it is refilled
  }
  bf16* dseq = dqkv + static_cast<size_t>(b) * T * stride + h * kHs;
  StoreRows(dseq + C, stride, k0 + 16 * warp, T, dk, 1.0f, g, q);
  StoreRows(dseq + 2 * C, stride, k0 + 16 * warp, T, dv, 1.0f, g, q);
}

// dQ: block = 64 queries of one (b, h); loops over the key tiles at and
// below the diagonal.
__global__ void __launch_bounds__(kThreads)
    QueryKernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                int T, int C, int NH, float scale, float scale_log2) {
  __shared__ __align__(16) bf16 k_tiles[2][kTile * kLd];
  __shared__ __align__(16) bf16 v_tiles[2][kTile * kLd];
  const int tiles = (T + kTile - 1) / kTile;
  const int qt = tiles - 1 - blockIdx.x;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t stride = 3 * static_cast<size_t>(C);
  const bf16* seq = qkv + static_cast<size_t>(b) * T * stride + h * kHs;
  const bf16* dout_seq = dout + static_cast<size_t>(b) * T * C + h * kHs;
  const int q0 = qt * kTile;

  Frag qa[kHs / 16], da[kHs / 16];
  // This block's queries and their dout pass through buffer 1 first.
  LoadTile(k_tiles[1], seq, stride, q0, T);
  LoadTile(v_tiles[1], dout_seq, C, q0, T);
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < kHs / 16; ++kc) {
    qa[kc] = LoadA(k_tiles[1], 16 * warp, kc, g, q);
    da[kc] = LoadA(v_tiles[1], 16 * warp, kc, g, q);
  }
  __syncthreads();
  const int row[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool valid = row[half] < T;
    row_lse[half] = valid ? lse[static_cast<size_t>(bh) * T + row[half]] : INFINITY;
    row_delta[half] = valid ? delta[static_cast<size_t>(bh) * T + row[half]] : 0.0f;
  }

  float dq[kHs / 8][4];
  Zero<kHs / 8>(dq);
  LoadKeyValuesAsync(k_tiles[0], v_tiles[0], seq, stride, C, 0, T);
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    NextKeyValueTile(k_tiles, v_tiles, seq, stride, C, kt, qt, T);
    const bf16* k_tile = k_tiles[kt & 1];
    const bf16* v_tile = v_tiles[kt & 1];
    const bool diagonal = kt == qt;
    float p[kTile / 8][4], ds[kTile / 8][4];
    ProductWithRows(p, qa, k_tile, lane);   // S = Q K^T
    ProductWithRows(ds, da, v_tile, lane);  // dP = dO V^T
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1, key = k0 + 8 * j + 2 * q + (e & 1);
        // Below the diagonal every key precedes every row, and is < T.
        const bool visible = !diagonal || (key <= row[half] && key < T);
        const float prob = visible ? exp2f(p[j][e] * scale_log2 - row_lse[half]) : 0.0f;
        ds[j][e] = prob * (ds[j][e] - row_delta[half]) * scale;
      }
    }
    AccumulateProduct(dq, ds, k_tile, lane);  // dQ += dS @ K
    __syncthreads();                          // done with this buffer before it is refilled
  }
  bf16* dseq = dqkv + static_cast<size_t>(b) * T * stride + h * kHs;
  StoreRows(dseq, stride, q0 + 16 * warp, T, dq, 1.0f, g, q);
}

}  // namespace

int FlashAttentionForward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH,
                          void* stream) {
  if (B == 0 || T == 0) return 0;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(kHs));
  const dim3 grid(CeilDiv(T, kTile), B * NH);
  ForwardKernel<<<grid, kThreads, 0, AsStream(stream)>>>(
      static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv), T, C, NH, scale_log2);
  return LaunchStatus();
}

int FlashAttentionBackward(void* dqkv, float* delta, const void* dout, const void* out,
                           const void* qkv, const float* lse, int B, int T, int C, int NH,
                           void* stream) {
  if (B == 0 || T == 0) return 0;
  const float scale = 1.0f / sqrtf(static_cast<float>(kHs));
  const float scale_log2 = kLog2e * scale;
  const size_t rows = static_cast<size_t>(B) * NH * T;
  DeltaKernel<<<CeilDiv(rows, kWarps), kThreads, 0, AsStream(stream)>>>(
      delta, static_cast<const bf16*>(dout), static_cast<const bf16*>(out), B, T, C, NH);
  int status = LaunchStatus();
  if (status != 0) return status;
  const dim3 grid(CeilDiv(T, kTile), B * NH);
  KeyValueKernel<<<grid, kThreads, 0, AsStream(stream)>>>(
      static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout), static_cast<const bf16*>(qkv), lse,
      delta, T, C, NH, scale, scale_log2);
  status = LaunchStatus();
  if (status != 0) return status;
  QueryKernel<<<grid, kThreads, 0, AsStream(stream)>>>(
      static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout), static_cast<const bf16*>(qkv), lse,
      delta, T, C, NH, scale, scale_log2);
  return LaunchStatus();
}

}  // namespace muster::kernels::fast
