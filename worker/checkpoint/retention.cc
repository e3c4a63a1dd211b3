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

absl::StatusOr<LineageCheckpoints> LineageSteps(Env* env, const std::string& dir,
                                                const std::string& lineage) {
  auto entries = ListCheckpoints(env, dir);
  if (!entries.ok()) return entries.status();
  LineageCheckpoints found;
  for (const CheckpointEntry& entry : *entries) {
    auto manifest = ReadManifest(env, entry.path);
    if (manifest.ok()) {
      if (manifest->lineage == lineage) found.committed.push_back(entry.step);
    } else if (manifest.status().code() == absl::StatusCode::kNotFound ||
               manifest.status().code() == absl::StatusCode::kDataLoss) {
      found.torn.push_back(entry.step);
    }
  }
  return found;
}

absl::Status ApplyRetention(Env* env, const std::string& dir, int keep_last, int keep_every,
                            int protect, const std::string& lineage,
                            const std::vector<int>& unverified, std::vector<std::string>* deleted) {
  auto found = LineageSteps(env, dir, lineage);
  if (!found.ok()) return found.status();
  std::vector<int> counted;
  for (int step : found->committed) {
    const bool skipped = step != protect &&
                         std::find(unverified.begin(), unverified.end(), step) != unverified.end();
    if (step <= protect && !skipped) counted.push_back(step);
  }
  std::vector<int> doomed = StepsToDelete(counted, keep_last, keep_every);
  for (int step : found->torn) {
    if (step < protect) doomed.push_back(step);
  }
  std::sort(doomed.begin(), doomed.end());
  absl::Status first_error;
  for (int step : doomed) {
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
