// The settings that decide what an optimizer step does to the weights,
// besides the model's shape and train.seed (a checkpoint of another shape
// or seed is refused): the optimizer's, train.steps (the schedule's end)
// and the batch per rank. Each manifest records them, so that a run
// resumed with other values says what changed and what it does to the
// next step's learning rate, instead of changing course silently. Another
// value is often meant (a longer run, a lower lr after a spike), so it is
// a note, never an error.
//
// Pure functions; thread-compatible.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "worker/config/config.h"

namespace muster::worker {

// (field path, value as ConfigToYaml writes it), in ConfigFields() order.
using TrainingSettings = std::vector<std::pair<std::string, std::string>>;

TrainingSettings TrainingSettingsOf(const TrainConfig& config);

// How `config` differs from `saved` (a manifest's record), e.g.
// "optim.lr 0.001 -> 0.002; train.steps 400 -> 800; the next step's
// learning rate is 1.20e-03 (5.10e-04 with the saved settings)", the rate
// only where it differs. `next_step` is the
// 0-based index of the step the resumed run takes first. Empty when they
// agree, and when `saved` is empty (a manifest from before the record).
// A field `saved` names that this build does not know is listed as such.
std::string DescribeSettingChanges(const TrainingSettings& saved, const TrainConfig& config,
                                   int next_step);

}  // namespace muster::worker
