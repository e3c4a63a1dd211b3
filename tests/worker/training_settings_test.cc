// The settings a checkpoint records of the run that saved it
// (worker/trainer/training_settings.h), and how a resume with others is
// described. The resume itself, saying so in its log, is in
// tests/worker/checkpoint/checkpoint_test.cc.
#include "worker/trainer/training_settings.h"

#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/match.h"
#include "worker/optim/optim.h"

namespace muster::worker {
namespace {

std::string Value(const TrainingSettings& settings, const std::string& path) {
  for (const auto& [name, value] : settings) {
    if (name == path) return value;
  }
  return "<absent>";
}

TEST_CASE("the recorded settings: the optimizer's, the schedule's end and the batch") {
  TrainConfig config;
  config.optim.lr = 0.002;
  config.train.steps = 400;
  const TrainingSettings settings = TrainingSettingsOf(config);
  CHECK(Value(settings, "optim.lr") == "0.002");
  CHECK(Value(settings, "optim.schedule") == "\"cosine\"");
  CHECK(Value(settings, "optim.grad_clip") == "1.0");
  CHECK(Value(settings, "train.steps") == "400");
  CHECK(Value(settings, "data.micro_batch") == "8");
  CHECK(Value(settings, "data.grad_accumulation") == "1");
  // Not what a resume may change freely, nor what it refuses to change.
  CHECK(Value(settings, "parallel.strategy") == "<absent>");
  CHECK(Value(settings, "checkpoint.every") == "<absent>");
  CHECK(Value(settings, "train.log_every") == "<absent>");
  CHECK(Value(settings, "train.seed") == "<absent>");
  CHECK(Value(settings, "model.dim") == "<absent>");
}

TEST_CASE("a resume with other settings names each change, and the next step's rate") {
  TrainConfig saved;
  saved.optim.lr = 0.001;
  saved.optim.min_lr = 0.0001;
  saved.train.steps = 400;
  const TrainingSettings record = TrainingSettingsOf(saved);

  SECTION("the same settings: nothing to say") {
    CHECK(DescribeSettingChanges(record, saved, 200).empty());
  }
  SECTION("a longer run: the cosine now decays over 800 steps") {
    TrainConfig longer = saved;
    longer.train.steps = 800;
    const std::string changes = DescribeSettingChanges(record, longer, 200);
    INFO(changes);
    CHECK(absl::StartsWith(changes, "train.steps 400 -> 800; the next step's learning rate is "));
    const float now = LearningRate(longer.optim, 200, 800);
    const float before = LearningRate(saved.optim, 200, 400);
    REQUIRE(now > before);
    char expected[128];
    std::snprintf(expected, sizeof(expected), "is %.2e (%.2e with the saved settings)", now,
                  before);
    CHECK(absl::StrContains(changes, expected));
  }
  SECTION("another lr and micro-batch") {
    TrainConfig other = saved;
    other.optim.lr = 0.002;
    other.data.micro_batch = 4;
    const std::string changes = DescribeSettingChanges(record, other, 200);
    INFO(changes);
    CHECK(absl::StartsWith(changes, "data.micro_batch 8 -> 4; optim.lr 0.001 -> 0.002; "));
  }
  SECTION("a constant rate past its warmup: the steps change nothing of the rate") {
    TrainConfig constant = saved;
    constant.optim.schedule = "constant";
    const TrainingSettings constant_record = TrainingSettingsOf(constant);
    constant.train.steps = 800;
    CHECK(DescribeSettingChanges(constant_record, constant, 200) == "train.steps 400 -> 800");
  }
  SECTION("a manifest from before the record: nothing is compared") {
    TrainConfig other = saved;
    other.optim.lr = 0.5;
    CHECK(DescribeSettingChanges({}, other, 200).empty());
  }
  SECTION("a field this build does not know is named") {
    TrainingSettings newer = record;
    newer.emplace_back("optim.nesterov", "true");
    CHECK(DescribeSettingChanges(newer, saved, 200) ==
          "optim.nesterov true (a field this build does not know)");
  }
}

}  // namespace
}  // namespace muster::worker
