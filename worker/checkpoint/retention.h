// Which checkpoints to keep: of this run's lineage, the newest
// `keep_last`, plus every one whose step is a multiple of `keep_every`
// (when > 0). Torn or corrupt
// directories count like any other; deleting them is what lets space be
// reclaimed after a crash.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/checkpoint/env.h"

namespace muster::worker {

// The steps (from `steps`, any order) that the rule drops.
std::vector<int> StepsToDelete(std::vector<int> steps, int keep_last, int keep_every);

// The steps of the committed checkpoints in `dir` of `lineage` (one whose
// manifest cannot be read counts as the lineage's), in no particular order.
absl::StatusOr<std::vector<int>> LineageSteps(Env* env, const std::string& dir,
                                              const std::string& lineage);

// Applies the rule to the committed checkpoints in `dir` of `lineage`
// (Manifest::lineage; one whose manifest cannot be read counts as the
// lineage's), never touching `protect` (the one just committed). Other
// runs' checkpoints, among them the one an explicit resume path started
// this run from, are neither counted nor deleted. Returns the first error
// but tries every deletion; names deleted directories in *deleted.
absl::Status ApplyRetention(Env* env, const std::string& dir, int keep_last, int keep_every,
                            int protect, const std::string& lineage,
                            std::vector<std::string>* deleted);

}  // namespace muster::worker
