#include "worker/checkpoint/retention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/checkpoint/reader.h"

namespace muster::worker {

std::vector<int> StepsToDelete(std::vector<int> steps, int keep_last, int keep_every) {
  std::sort(steps.begin(), steps.end());
  std::vector<int> doomed;
  const int newest_kept = static_cast<int>(steps.size()) - std::max(keep_last, 0);
  for (int i = 0; i < newest_kept; ++i) {
    if (keep_every > 0 && steps[i] % keep_every == 0) continue;
    doomed.push_back(steps[i]);
  }
  return doomed;
}

absl::StatusOr<std::vector<int>> LineageSteps(Env* env, const std::string& dir,
                                              const std::string& lineage) {
  auto entries = ListCheckpoints(env, dir);
  if (!entries.ok()) return entries.status();
  std::vector<int> steps;
  for (const CheckpointEntry& entry : *entries) {
    auto manifest = ReadManifest(env, entry.path);
    if (manifest.ok() && manifest->lineage != lineage) continue;
    steps.push_back(entry.step);
  }
  return steps;
}

absl::Status ApplyRetention(Env* env, const std::string& dir, int keep_last, int keep_every,
                            int protect, const std::string& lineage,
                            std::vector<std::string>* deleted) {
  auto steps = LineageSteps(env, dir, lineage);
  if (!steps.ok()) return steps.status();
  absl::Status first_error;
  for (int step : StepsToDelete(*steps, keep_last, keep_every)) {
    if (step == protect) continue;
    const std::string path = dir + "/" + StepDirName(step);
    absl::Status removed = env->RemoveAll(path);
    if (!removed.ok() && first_error.ok()) {
      first_error = absl::UnavailableError(absl::StrCat("retention: ", removed.message()));
    }
    if (removed.ok()) deleted->push_back(path);
  }
  return first_error;
}

}  // namespace muster::worker
