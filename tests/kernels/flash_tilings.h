// Every compiled tiling of flash attention's kernels (flash_attention.h),
// named, the math's default first: what fast_cuda_test (on a GPU and on
// the emulation) and simt_test run through.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "kernels/fast/flash_attention.h"

namespace muster::kernels::fast {

inline FlashTiling MakeTiling(FlashKernelTiling forward, FlashKernelTiling key_value,
                              FlashKernelTiling query, bool stored_ds = false) {
  FlashTiling tiling;
  tiling.forward = forward;
  tiling.key_value = key_value;
  tiling.query = query;
  tiling.stored_ds = stored_ds;
  return tiling;
}

// Names: f(orward) rows/step, kv rows/step and r(egisters) or s(hared
// memory) for the values, q rows/step, /N blocks per SM where capped;
// "dS" for a stored dS (its dQ kernel a product of dS and K).
inline std::vector<std::pair<std::string, FlashTiling>> CompiledFlashTilings(FlashMath math) {
  if (math == FlashMath::kTf32) {
    return {{"default", FlashDefaultTiling(FlashMath::kTf32)},
            {"f16/32 kv16/16s q16/16",
             MakeTiling({16, 32, false, 0}, {16, 16, false, 0}, {16, 16, false, 0})},
            {"f16/64 kv16/32s",
             MakeTiling({16, 64, false, 0}, {16, 32, false, 0}, {16, 32, false, 0})}};
  }
  return {
      {"default", FlashTiling{}},
      {"kv16/32r q16/64", MakeTiling({32, 64, false, 0}, {16, 32, true, 0}, {16, 64, false, 0})},
      {"f32/32 kv16/32s q16/32",
       MakeTiling({32, 32, false, 0}, {16, 32, false, 0}, {16, 32, false, 0})},
      {"f16/64 kv16/64r q16/16/4",
       MakeTiling({16, 64, false, 0}, {16, 64, true, 0}, {16, 16, false, 4})},
      {"f16/32 kv16/64s q32/32",
       MakeTiling({16, 32, false, 0}, {16, 64, false, 0}, {32, 32, false, 0})},
      {"kv16/16s/4", MakeTiling({32, 64, false, 0}, {16, 16, false, 4}, {16, 64, false, 0})},
      {"kv32/32s", MakeTiling({32, 64, false, 0}, {32, 32, false, 0}, {16, 64, false, 0})},
      {"dS kv16/32r/3 q16/64",
       MakeTiling({32, 64, false, 0}, {16, 32, true, 3}, {16, 64, false, 0}, true)},
      {"dS kv16/32s q32/64",
       MakeTiling({32, 64, false, 0}, {16, 32, false, 0}, {32, 64, false, 0}, true)}};
}

}  // namespace muster::kernels::fast
