// Training data: token shards in llm.c's format, memory-mapped, read as one
// global stream of samples.
//
// Shard file: 256 little-endian int32 header words, [0]=20240520 (magic),
// [1]=1 (version), [2]=number of tokens; then that many uint16 token ids.
// The file size must be exactly 1024 + 2 * ntok.
//
// Sample i of the stream is T+1 consecutive tokens (inputs are the first T,
// targets the last T). Each shard is cut into windows of T+1 tokens with
// stride T; an epoch visits every window of every shard once, in a
// pseudo-random order fixed by (seed, epoch). Sample i is a pure function of
// i, so any number of ranks can split the stream and a resumed job
// continues it exactly from a saved global sample index.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::worker {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 256 * sizeof(int32_t);

// One shard, mapped read-only. Open checks the header, the file size and
// that every token is < vocab; errors are INVALID_ARGUMENT (or NOT_FOUND)
// naming the file and what is wrong.
class TokenShard {
 public:
  static absl::StatusOr<std::unique_ptr<TokenShard>> Open(const std::string& path, int vocab);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  size_t size() const { return size_; }  // tokens
  const uint16_t* tokens() const { return tokens_; }

 private:
  TokenShard() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  size_t size_ = 0;
};

// Writes a shard (used by tools/mkdata and tests). Tokens must be < 65536.
absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens);

class TokenStream {
 public:
  // `pattern` is a glob (sorted matches); NOT_FOUND if it matches nothing,
  // INVALID_ARGUMENT if no shard holds even one window of seq_len + 1.
  static absl::StatusOr<std::unique_ptr<TokenStream>> Open(const std::string& pattern, int seq_len,
                                                           int vocab, uint64_t seed);

  int seq_len() const { return seq_len_; }
  uint64_t samples_per_epoch() const { return windows_; }
  const std::vector<std::string>& files() const;

  // Sample `index` (any value; epochs repeat with a new order):
  // inputs (T,), targets (T,).
  void Sample(uint64_t index, int* inputs, int* targets) const;

  // Samples first, first+1, ..., first+count-1: inputs, targets (count, T).
  void Batch(uint64_t first, int count, int* inputs, int* targets) const;

 private:
  TokenStream() = default;
  struct Impl;
  std::shared_ptr<const Impl> impl_;
  int seq_len_ = 0;
  uint64_t windows_ = 0;
};

}  // namespace muster::worker
