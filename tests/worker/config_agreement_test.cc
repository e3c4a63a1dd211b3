// One config for every rank (worker/trainer/config_agreement.h): what is
// compared, how differences are named, and thread-ranks creating real
// Trainers over Gloo, one of them with a stale config (the real-process
// case, two `launch` agents with their own train.yaml, is in
// tests/worker/strategy/ddp_launch_test.cc).
#include "worker/trainer/config_agreement.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/worker/checkpoint/tiny_job.h"
#include "tests/worker/thread_ranks.h"
#include "worker/trainer/trainer.h"

namespace muster::worker {
namespace {

std::string FreshDir(const std::string& name) {
  return testing::FreshDir("config_agreement_test", name);
}

std::string Value(const std::vector<ConfigLine>& lines, const std::string& name) {
  for (const auto& [line_name, value] : lines) {
    if (line_name == name) return value;
  }
  return "<absent>";
}

TEST_CASE("compared: every field but paths; resume by its kind; the resolved lines last") {
  TrainConfig config = testing::TinyConfig("/data/a");
  config.data.val = "/data/a/val_*.bin";
  config.train.metrics_file = "/out/m.jsonl";
  const std::vector<ConfigLine> lines = ComparedConfig(config, {{"device (resolved)", "cpu"}});
  CHECK(Value(lines, "optim.lr") == "0.01");
  CHECK(Value(lines, "data.micro_batch") == "4");
  CHECK(Value(lines, "model.layers") == "2");
  CHECK(Value(lines, "checkpoint.every") == "4");
  for (const char* path :
       {"data.train", "data.val", "train.metrics_file", "checkpoint.dir", "checkpoint.resume"}) {
    CHECK(Value(lines, path) == "<absent>");
  }
  CHECK(Value(lines, "checkpoint.resume (kind)") == "auto");
  config.checkpoint.resume = "/ckpt/step_00000004";
  CHECK(Value(ComparedConfig(config, {}), "checkpoint.resume (kind)") == "a checkpoint path");
  CHECK(lines.back() == ConfigLine{"device (resolved)", "cpu"});
  CHECK(ParseConfigLines(ConfigLinesText(lines)) == lines);
}

TEST_CASE("differences name each field, both values and which side lacks a line") {
  const std::vector<ConfigLine> rank0 = {
      {"optim.lr", "0.001"}, {"train.steps", "100"}, {"model.dim", "64"}, {"only.rank0", "1"}};
  const std::vector<ConfigLine> mine = {
      {"optim.lr", "0.002"}, {"train.steps", "100"}, {"model.dim", "32"}, {"only.mine", "x"}};
  CHECK(ConfigDifferences(rank0, rank0).empty());
  CHECK(ConfigDifferences(mine, rank0) ==
        "optim.lr is 0.002 here and 0.001 on rank 0; model.dim is 32 here and 64 on rank 0; "
        "only.mine is x here and missing on rank 0; only.rank0 is missing here and 1 on rank 0");
}

// Trainer::Create on `configs.size()` thread-ranks; each rank's status.
std::vector<absl::Status> CreateOnRanks(const std::vector<TrainConfig>& configs) {
  std::vector<absl::Status> results(configs.size());
  worker::testing::RunRanks(static_cast<int>(configs.size()),
                            [&](int rank, ParallelStrategy* strategy) {
                              TrainerOptions options;
                              options.strategy = strategy;
                              options.log = std::tmpfile();
                              options.progress_bar = false;
                              results[rank] = Trainer::Create(configs[rank], options).status();
                            });
  return results;
}

TEST_CASE("thread-ranks: a stale config on one rank stops every rank, naming it and the fields") {
  const std::string dir = FreshDir("stale");
  testing::WriteShard(dir);
  TrainConfig config = testing::TinyConfig(dir);
  config.checkpoint = {};
  config.source = dir + "/train.yaml";
  // Rank 1 reads the same shard at another path: that is no difference.
  const std::string other = FreshDir("stale_copy");
  std::filesystem::copy_file(dir + "/train_000.bin", other + "/train_000.bin");
  TrainConfig copy_elsewhere = config;
  copy_elsewhere.data.train = other + "/train_*.bin";
  copy_elsewhere.source = other + "/train.yaml";
  TrainConfig stale = config;
  stale.optim.lr = 2e-2;
  stale.data.micro_batch = 3;

  SECTION("the same config, the data at another path: every rank starts") {
    for (const absl::Status& status : CreateOnRanks({config, copy_elsewhere, config})) {
      CHECK(status.ok());
    }
  }
  SECTION("rank 2 has another lr and micro_batch") {
    const std::vector<absl::Status> results = CreateOnRanks({config, copy_elsewhere, stale});
    INFO(results[0].ToString() << "\n" << results[1].ToString() << "\n" << results[2].ToString());
    CHECK(absl::IsInvalidArgument(results[2]));
    CHECK(absl::StrContains(results[2].message(), "the config of rank 2 (host "));
    CHECK(absl::StrContains(results[2].message(),
                            ", " + config.source +
                                ") differs from rank 0's: data.micro_batch is 3 here and 4 on "
                                "rank 0; optim.lr is 0.02 here and 0.01 on rank 0. Every rank "
                                "must train with the same config"));
    for (int rank : {0, 1}) {
      CHECK(absl::IsAborted(results[rank]));
      CHECK(results[rank].message() == "the config of rank 2 differs from rank 0's (see its log)");
    }
  }
  SECTION("a shard of another length on rank 1: its windows differ") {
    std::vector<uint16_t> tokens(4000, 'a');
    REQUIRE(WriteTokenShard(other + "/train_000.bin", tokens).ok());
    const std::vector<absl::Status> results = CreateOnRanks({config, copy_elsewhere});
    CHECK(absl::IsInvalidArgument(results[1]));
    CHECK(absl::StrContains(results[1].message(),
                            "data.train (windows) is 249 here and 499 on "
                            "rank 0"));
    CHECK(absl::IsAborted(results[0]));
  }
}

}  // namespace
}  // namespace muster::worker
