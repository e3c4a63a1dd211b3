// The small training job the in-process checkpoint tests share: a fresh
// directory, a shard a tiny model learns, and its config.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "worker/config/config.h"
#include "worker/data/data.h"

namespace muster::worker::testing {

// An empty directory under TEST_TMPDIR: <prefix>_<name>_<n>.
inline std::string FreshDir(const std::string& prefix, const std::string& name) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/", prefix, "_", name, "_", ++counter);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A byte pattern with period 13 (prime to T = 16): a tiny model learns it.
inline void WriteShard(const std::string& dir) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 8000; ++i) tokens.push_back("abcdefghijklm"[i % 13]);
  REQUIRE(WriteTokenShard(dir + "/train_000.bin", tokens).ok());
}

// L=2, C=32, NH=2, T=16, B=4 on the shard in `dir`; checkpoints every 4
// of 12 steps into dir/ckpt.
inline TrainConfig TinyConfig(const std::string& dir) {
  TrainConfig config;
  config.model = {2, 2, 32, 256, 16};
  config.data.train = dir + "/train_*.bin";
  config.data.micro_batch = 4;
  config.optim.lr = 1e-2;
  config.optim.schedule = "cosine";
  config.train.steps = 12;
  config.train.log_every = 1000;
  config.device = "cpu";
  config.checkpoint.dir = dir + "/ckpt";
  config.checkpoint.every = 4;
  config.checkpoint.keep_last = 10;
  return config;
}

}  // namespace muster::worker::testing
