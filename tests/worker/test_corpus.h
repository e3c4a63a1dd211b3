// The token shard the in-process training tests read (ddp_test, fsdp_test,
// pipeline_test): 8000 ids below 97 in a fixed pattern with some structure,
// so the loss moves and no short period repeats within a batch.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "worker/data/data.h"

namespace muster::worker::testing {

// Writes the shard under TEST_TMPDIR/<name>/ (once per process and name)
// and returns the glob for data.train.
inline std::string TestCorpus(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  const std::string shard = dir + "/train_000.bin";
  if (!std::filesystem::exists(shard)) {
    std::filesystem::create_directories(dir);
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 8000; ++i) tokens.push_back(static_cast<uint16_t>((i * 7 + i / 13) % 97));
    REQUIRE(WriteTokenShard(shard, tokens).ok());
  }
  return dir + "/train_*.bin";
}

}  // namespace muster::worker::testing
