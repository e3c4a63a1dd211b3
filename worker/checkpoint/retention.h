// Which checkpoints to keep: of this run's lineage, the newest
// `keep_last`, plus every one whose step is a multiple of `keep_every`
// (when > 0). Only checkpoints whose manifest reads count toward
// `keep_last`, so a torn directory never pushes a loadable checkpoint
// out; a torn one older than the checkpoint just committed is deleted
// (that is what lets space be reclaimed after a crash).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/checkpoint/env.h"

namespace muster::worker {

// The steps (from `steps`, any order) that the rule drops.
std::vector<int> StepsToDelete(std::vector<int> steps, int keep_last, int keep_every);

// The step_N directories of `dir` that retention may count or delete.
struct LineageCheckpoints {
  std::vector<int> committed;  // a manifest that reads, of the lineage
  std::vector<int> torn;       // no manifest, or one that is not a manifest
};

// Lists `dir`: the checkpoints of `lineage` (Manifest::lineage), and the
// torn ones, whose lineage cannot be told (counted as the lineage's).
// Directories whose manifest could not be read for another reason (an I/O
// or permission error) are in neither: retention leaves what it cannot
// read alone. Steps in no particular order.
absl::StatusOr<LineageCheckpoints> LineageSteps(Env* env, const std::string& dir,
                                                const std::string& lineage);

// Applies the rule to the committed checkpoints in `dir` of `lineage` up to
// `protect` (the one just committed, never touched), and deletes the torn
// ones older than it. A checkpoint of the lineage newer than `protect` is
// one the resume skipped (it did not verify): it is neither counted nor
// deleted, and a save of its step replaces it. So are the `unverified`
// steps, older ones the resume skipped (a CRC mismatch in a preemption's
// save, say): counted, they would push out the checkpoint the run resumed
// from, leaving one that loads where keep_last promised more. Other runs'
// checkpoints, among them the one an explicit resume path started this
// run from, are neither counted nor deleted. Returns the first error but
// tries every deletion; names deleted directories in *deleted.
absl::Status ApplyRetention(Env* env, const std::string& dir, int keep_last, int keep_every,
                            int protect, const std::string& lineage,
                            const std::vector<int>& unverified, std::vector<std::string>* deleted);

}  // namespace muster::worker
