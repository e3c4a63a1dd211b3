// A CPU emulation of the CUDA features kernels/fast's hand-written
// kernels use, to run them on a machine without a GPU and
// check their logic (indexing, fragment layouts, masking, pipelining,
// barriers) against the CPU back end. It proves nothing about speed, and
// its arithmetic is not the GPU's bit for bit: the MMAs sum their products
// in double precision and round once. No library does this: CUDA has no
// CPU target, and the simulators that exist (GPGPU-Sim and the like) are
// whole-GPU models that Debian does not package.
//
// How it runs a kernel: each CUDA thread of a block is a fiber on the
// calling thread, and the block's fibers take turns, each running
// until it waits at a barrier: __syncthreads, or a warp-wide instruction
// (mma.sync, ldmatrix, shfl, vote, __syncwarp), which every lane must reach
// before any goes on. Blocks run one after another. A block whose threads
// all wait and none can go on is a deadlock: the launch fails
// (cudaErrorLaunchFailure) and LastErrorMessage says who waited where.
//
// What it catches that a plain host port would not:
// - cp.async copies land only at the cp.async.wait_group that covers
//   them; until then their destination holds NaN (all bits set), so a
//   thread that reads a tile before waiting reads NaN.
// - Dynamic shared memory starts each block as NaN too.
// - SetSchedule changes the order in which the fibers run between
//   waits: shuffled, or each time the first fiber that can run, so one
//   warp runs ahead of the others as far as the barriers let it. A read
//   of shared memory that another warp writes (or a cp.async poisons)
//   without a barrier in between then sees the write or not, by schedule.
//
// The race checker: simt.cc built with MUSTER_SIMT_TSAN, in a binary
// whose kernels are compiled and linked with -fsanitize=thread, reports
// every pair of accesses to one address by two CUDA threads of a block,
// one of them a write, that no __syncthreads or __syncwarp orders (the
// hazards of compute-sanitizer's racecheck, in shared and global memory),
// whether or not the schedule interleaved them. ThreadSanitizer prints
// each with both stacks and the threads' names ("CUDA thread 37 of block
// (2, 5, 0)"), and the process exits with status 66. shfl, vote, ldmatrix
// and mma.sync order no memory, as on the GPU; blocks are ordered one after
// another, so a race between two blocks is not reported. ldmatrix reads
// each lane's 16-byte row; cp.async reads its source and writes its
// destination both when issued and when waited for.
//
// The memory checker: simt.cc built with MUSTER_SIMT_ASAN, in a binary
// whose kernels are compiled and linked with -fsanitize=address, reports
// an access out of bounds of a device buffer (Malloc gives exactly the
// bytes asked for) or of the dynamic shared memory, as compute-sanitizer's
// memcheck would, and names the CUDA thread and block that made it. Not
// the static __shared__ arrays of kernel templates: the compiler gives
// such arrays (vague linkage) no redzones. The fibers' stacks are
// announced to AddressSanitizer at every switch.
//
// A kernel source compiled with MUSTER_SIMT defined (common.cuh includes
// this header then) calls the functions below where it would use inline
// PTX, and must be compiled with -fno-strict-aliasing: CUDA code reads
// registers through reinterpret_cast freely, which nvcc allows and g++'s
// optimizer need not. The header redefines threadIdx, blockIdx, blockDim,
// gridDim, __syncthreads, __syncwarp, __shfl_xor_sync, __any_sync,
// __shared__ (as `static`: the block's fibers share one copy, and blocks
// run one at a time) and the runtime calls a test makes (Malloc and the
// rest, below).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace muster::simt {

// The calling fiber's coordinates. Outside a kernel: a failed check.
const uint3& ThreadIdx();
const uint3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();

void SyncThreads();
// __syncwarp(): every lane of the calling warp waits for the others.
void SyncWarp();

// Every lane of the warp gives `value`; returns lane (lane ^ lane_mask)'s.
uint32_t ShflXor32(uint32_t value, int lane_mask);
template <typename T>
T ShflXor(T value, int lane_mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits = ShflXor32(bits, lane_mask);
  std::memcpy(&value, &bits, 4);
  return value;
}

// __any_sync(0xffffffff, predicate): whether any lane of the warp gives
// true; every lane gets the same answer.
bool AnySync(bool predicate);

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with c as both C
// and D (PTX ISA fragment layouts; g = lane / 4, q = lane % 4):
//   A (16 x 16): a[0] (g, 2q..2q+1), a[1] (g+8, 2q..), a[2] (g, 2q+8..),
//                a[3] (g+8, 2q+8..), the lower column in the low half
//   B (16 x 8):  b0 (k = 2q..2q+1, n = g), b1 (k = 2q+8.., n = g)
//   C (16 x 8):  c[0], c[1] (g, 2q..2q+1), c[2], c[3] (g+8, 2q..2q+1)
void MmaBf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, c as C and D:
//   A (16 x 8): a[0] (g, q), a[1] (g+8, q), a[2] (g, q+4), a[3] (g+8, q+4)
//   B (8 x 8):  b0 (k = q, n = g), b1 (k = q+4, n = g)
//   C: as MmaBf16's.
// The operands' low 13 bits are ignored, as the tensor cores do.
void MmaTf32(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives `row`,
// the address of row l % 8 of 8x8 matrix l / 8; r[i] gets matrix i's
// (row l / 4, columns 2(l % 4), 2(l % 4) + 1), or with `trans` (rows
// 2(l % 4), 2(l % 4) + 1, column l / 4), the first in the low half.
void LdMatrixX4(const void* row, uint32_t* r, bool trans);

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: copies src_bytes
// (0 or 16) and zero-fills the rest of 16 bytes, when a later
// CpAsyncWait covers it. CpAsyncCommit closes the calling thread's group
// of copies; CpAsyncWait(n) completes all but its n most recent groups.
void CpAsync16(void* dst, const void* src, int src_bytes);
void CpAsyncCommit();
void CpAsyncWait(int pending);

// The block's dynamic shared memory (`extern __shared__`).
unsigned char* DynamicShared();

// Runs `kernel` as grid x block threads with `dynamic_shared_bytes` of
// dynamic shared memory (at most 228 KB, an H100's). Returns 0, or a CUDA
// error code that LastError then returns too.
int Launch(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const std::function<void()>& kernel);

// The error of the most recent failed launch, cleared by reading it (as
// cudaGetLastError); and what went wrong, in words.
int LastError();
std::string LastErrorMessage();

// The order the fibers of a block run in, each until it waits.
enum class Schedule {
  kRoundRobin,    // the default: every fiber that can run, in thread order, then again
  kShuffled,      // the same, the order shuffled every round (from the seed)
  kLowestFirst,   // always the lowest-numbered fiber that can run: warp 0 runs ahead
  kHighestFirst,  // always the highest: the last warp runs ahead
};
// The environment variable MUSTER_SIMT_SCHEDULE (round_robin, shuffled,
// lowest_first, highest_first) sets the schedule a process starts with.
void SetSchedule(Schedule schedule, uint64_t seed = 1);

// The CUDA runtime calls a test makes, on host memory: device buffers
// are host allocations (256-byte aligned), copies are memcpy whatever
// their kind, and everything is synchronous. The macros below put them in
// place of cudaMalloc and the rest.
cudaError_t Malloc(void** pointer, size_t bytes);
cudaError_t Free(void* pointer);
cudaError_t Memcpy(void* dst, const void* src, size_t bytes);
cudaError_t Memset(void* pointer, int value, size_t bytes);
cudaError_t Synchronize();
cudaError_t GetLastError();

// Counts since the process started, for tests to see that work ran.
struct Counters {
  uint64_t blocks = 0;
  uint64_t mma = 0;  // warp-wide MMAs
  uint64_t barriers = 0;
  uint64_t races = 0;  // data races reported (built with MUSTER_SIMT_TSAN)
};
Counters GetCounters();

}  // namespace muster::simt

// Device built-ins the kernels call that the host headers do not declare.
inline unsigned int __float_as_uint(float x) {
  unsigned int bits;
  std::memcpy(&bits, &x, 4);
  return bits;
}
inline float __uint_as_float(unsigned int bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim
#define threadIdx (::muster::simt::ThreadIdx())
#define blockIdx (::muster::simt::BlockIdx())
#define blockDim (::muster::simt::BlockDim())
#define gridDim (::muster::simt::GridDim())
#define __syncthreads() ::muster::simt::SyncThreads()
#define __syncwarp(...) ::muster::simt::SyncWarp()
#define __shfl_xor_sync(mask, value, lane_mask) ::muster::simt::ShflXor((value), (lane_mask))
#define __any_sync(mask, predicate) ::muster::simt::AnySync(predicate)
#define cudaMalloc(pointer, bytes) \
  ::muster::simt::Malloc(reinterpret_cast<void**>(pointer), (bytes))
#define cudaFree(pointer) ::muster::simt::Free(pointer)
#define cudaMemcpy(dst, src, bytes, kind) ::muster::simt::Memcpy((dst), (src), (bytes))
#define cudaMemset(pointer, value, bytes) ::muster::simt::Memset((pointer), (value), (bytes))
#define cudaDeviceSynchronize() ::muster::simt::Synchronize()
#define cudaGetLastError() ::muster::simt::GetLastError()
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
