// AdamW fused with the bf16 cast of the weights: one pass updates the fp32
// master weights and moments and writes the bf16 copy the GEMMs read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/adamw.h"

namespace muster::kernels::fast {

// A stretch of parameters that share the weight-decay setting: floats
// [begin, begin + count) of the buffers.
struct AdamWChunk {
  unsigned long long begin;
  unsigned long long count;
  unsigned int decay;  // 1: hyper.weight_decay applies; 0: no decay
};

// Most floats one block updates: runs longer than this are split.
constexpr unsigned int kAdamWChunkFloats = 16384;

// The runs split into chunks of at most kAdamWChunkFloats, in order.
inline std::vector<AdamWChunk> SplitAdamWRuns(const std::vector<AdamWChunk>& runs) {
  std::vector<AdamWChunk> chunks;
  for (const AdamWChunk& run : runs) {
    for (unsigned long long done = 0; done < run.count; done += kAdamWChunkFloats) {
      const unsigned long long left = run.count - done;
      chunks.push_back(AdamWChunk{run.begin + done,
                                  left < kAdamWChunkFloats ? left : kAdamWChunkFloats, run.decay});
    }
  }
  return chunks;
}

// kernels/adamw.h's update of params, m, v from grads (fp32), over runs of
// one set of buffers in one launch: block i updates chunks[i] (device
// memory, from SplitAdamWRuns), with hyper.weight_decay where the chunk
// has decay and 0 elsewhere. params_bf16: nullptr, or a bf16 copy of
// params (raw bits) that gets the new weights rounded to nearest even.
// aligned: every chunk starts on a multiple of 4 floats (then, with
// 16-byte aligned buffers, 128-bit accesses are used).
int AdamWUpdateChunks(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                      const AdamWChunk* chunks, int num_chunks, bool aligned,
                      const AdamWHyper& hyper, int step, void* stream);

// out (n, raw bf16 bits) = in (n) fp32 rounded to nearest even.
int CastToBf16(uint16_t* out, const float* in, size_t n, void* stream);

// out (n) fp32 = in (n, raw bf16 bits), exactly (kernels/bf16.h).
int CastFromBf16(float* out, const uint16_t* in, size_t n, void* stream);

}  // namespace muster::kernels::fast
