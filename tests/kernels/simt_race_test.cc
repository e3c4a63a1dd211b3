// The race checker of the CPU emulation (kernels/simt/simt.h, built with
// MUSTER_SIMT_TSAN and this file with -fsanitize=thread): small kernels
// with one synchronisation left out must be reported, and the same
// kernels with it must not. fast_simt_race_test runs kernels/fast's
// kernels under the same checker. Needs the CUDA headers, not a GPU:
// manual, run by scripts/test.sh after the CUDA build.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/simt/simt.h"

// The races below are meant: the assertions count them, so they must not
// also fail the process (ThreadSanitizer's exit status 66).
extern "C" const char* __tsan_default_options() { return "exitcode=0"; }

namespace muster::simt {
namespace {

// Races reported while `launch` runs (ThreadSanitizer reports a pair of
// code locations once per process, so every case below races at its own
// lines).
template <typename Launch>
uint64_t RacesDuring(Launch&& launch) {
  const uint64_t before = GetCounters().races;
  launch();
  return GetCounters().races - before;
}

TEST_CASE("a read of another warp's shared memory needs __syncthreads", "[race]") {
  std::vector<float> out(64);
  const auto kernel = [&](bool barrier) {
    return [&out, barrier] {
      __shared__ float tile[64];
      const int t = threadIdx.x;
      tile[t] = static_cast<float>(t);
      if (barrier) __syncthreads();
      out[t] = tile[(t + 32) % 64];  // the other warp's element
    };
  };
  CHECK(RacesDuring([&] { REQUIRE(Launch(dim3(1), dim3(64), 0, kernel(true)) == 0); }) == 0);
  CHECK(out[0] == 32.0f);
  CHECK(RacesDuring([&] { REQUIRE(Launch(dim3(1), dim3(64), 0, kernel(false)) == 0); }) >= 1);
}

TEST_CASE("__syncwarp orders a warp's lanes; a shuffle does not", "[race]") {
  std::vector<uint32_t> out(32);
  CHECK(RacesDuring([&] {
          Launch(dim3(1), dim3(32), 0, [&out] {
            __shared__ uint32_t words[32];
            const int lane = threadIdx.x;
            words[lane] = lane;
            __syncwarp();
            out[lane] = words[lane ^ 1];
          });
        }) == 0);
  CHECK(out[0] == 1);
  CHECK(RacesDuring([&] {
          Launch(dim3(1), dim3(32), 0, [&out] {
            __shared__ uint32_t words[32];
            const int lane = threadIdx.x;
            words[lane] = lane;
            // Every lane reaches the shuffle before any leaves it, but a
            // shuffle makes no promise about memory.
            const uint32_t neighbour = __shfl_xor_sync(0xffffffffu, static_cast<uint32_t>(lane), 1);
            out[lane] = words[lane ^ 1] + neighbour;
          });
        }) >= 1);
}

TEST_CASE("a wait for cp.async covers the thread's own copies; others' need a barrier", "[race]") {
  std::vector<float> source(64 * 4, 1.0f), out(64);
  const auto kernel = [&](bool barrier) {
    return [&source, &out, barrier] {
      __shared__ __align__(16) float tile[64 * 4];
      const int t = threadIdx.x;
      CpAsync16(&tile[4 * t], &source[4 * t], 16);
      CpAsyncCommit();
      CpAsyncWait(0);
      if (barrier) __syncthreads();
      out[t] = tile[4 * ((t + 32) % 64)];
    };
  };
  CHECK(RacesDuring([&] { Launch(dim3(1), dim3(64), 0, kernel(true)); }) == 0);
  CHECK(out[5] == 1.0f);
  CHECK(RacesDuring([&] { Launch(dim3(1), dim3(64), 0, kernel(false)); }) >= 1);
}

TEST_CASE("ldmatrix reads the rows its lanes name, which another warp may be writing", "[race]") {
  // Warp 1 writes an 8 x 8 bf16 matrix four times over (32 rows of 16
  // bytes); warp 0 reads it with ldmatrix.x4.
  std::vector<uint32_t> out(32 * 4);
  const auto kernel = [&](bool barrier) {
    return [&out, barrier] {
      __shared__ __align__(16) uint16_t rows[32 * 8];
      const int t = threadIdx.x;
      if (t >= 32) {
        for (int i = 0; i < 8; ++i) rows[8 * (t - 32) + i] = static_cast<uint16_t>(t);
      }
      if (barrier) __syncthreads();
      if (t < 32) LdMatrixX4(&rows[8 * t], &out[4 * t], false);
    };
  };
  CHECK(RacesDuring([&] { Launch(dim3(1), dim3(64), 0, kernel(true)); }) == 0);
  // Lane 0's first register: row 0 of matrix 0, written by thread 32.
  CHECK(out[0] == (32u | 32u << 16));
  CHECK(RacesDuring([&] { Launch(dim3(1), dim3(64), 0, kernel(false)); }) >= 1);
}

TEST_CASE("blocks reuse the same shared memory one after another: no race", "[race]") {
  std::vector<float> out(8 * 64);
  CHECK(RacesDuring([&] {
          Launch(dim3(8), dim3(64), 0, [&out] {
            __shared__ float tile[64];
            const int t = threadIdx.x;
            tile[t] = static_cast<float>(blockIdx.x * 64 + t);
            __syncthreads();
            out[blockIdx.x * 64 + t] = tile[63 - t];
          });
        }) == 0);
  CHECK(out[7 * 64] == 7 * 64 + 63);
}

}  // namespace
}  // namespace muster::simt
