#include "worker/trainer/training_settings.h"

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "worker/optim/optim.h"

namespace muster::worker {
namespace {

bool IsTrainingSetting(absl::string_view path) {
  // Every optim.* field, so that one added later is recorded too.
  return absl::StartsWith(path, "optim.") || path == "train.steps" || path == "data.micro_batch" ||
         path == "data.grad_accumulation";
}

}  // namespace

TrainingSettings TrainingSettingsOf(const TrainConfig& config) {
  TrainingSettings settings;
  for (const ConfigField& field : ConfigFields()) {
    if (IsTrainingSetting(field.path)) settings.emplace_back(field.path, field.get(config));
  }
  return settings;
}

std::string DescribeSettingChanges(const TrainingSettings& saved, const TrainConfig& config,
                                   int next_step) {
  if (saved.empty()) return "";
  std::map<std::string, const ConfigField*> fields;
  for (const ConfigField& field : ConfigFields()) fields[field.path] = &field;
  std::vector<std::string> changes;
  TrainConfig before = config;  // the saving run's settings over this run's others
  for (const auto& [path, value] : saved) {
    auto found = fields.find(path);
    if (found == fields.end()) {
      changes.push_back(absl::StrCat(path, " ", value, " (a field this build does not know)"));
      continue;
    }
    const std::string now = found->second->get(config);
    if (now == value) continue;
    changes.push_back(absl::StrCat(path, " ", value, " -> ", now));
    found->second->set(value, &before).IgnoreError();  // a value this build reads differently
  }
  if (changes.empty()) return "";
  const float lr_now = LearningRate(config.optim, next_step, config.train.steps);
  const float lr_before = LearningRate(before.optim, next_step, before.train.steps);
  if (lr_now != lr_before) {
    changes.push_back(absl::StrFormat(
        "the next step's learning rate is %.2e (%.2e with the saved settings)", lr_now, lr_before));
  }
  return absl::StrJoin(changes, "; ");
}

}  // namespace muster::worker
