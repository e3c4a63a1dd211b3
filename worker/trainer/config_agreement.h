// Every rank trains with one config. Under `launch` each node reads its own
// train.yaml, and a stale copy on one node would not fail by itself: a
// different learning rate or step count trains silently wrong or hangs at
// the end, a different data.micro_batch makes ranks read overlapping
// samples, a different model hangs in the first collective whose sizes
// differ. So at start-up rank 0 broadcasts its config and every rank
// compares it with its own, field by field, before any collective that
// depends on it.
//
// Compared: every train.yaml field but those holding paths (data.train,
// data.val, train.metrics_file, checkpoint.dir, checkpoint.resume's path),
// which may name the same file differently on each node; plus what the
// caller adds of what this node resolved (what `auto` became, how many
// samples its data holds). checkpoint.dir is checked by its lock instead
// (worker/checkpoint/dir_lock.h, SeesLock), and checkpoint.resume by its
// kind: auto, never, or a path.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "parallel/collectives.h"
#include "worker/config/config.h"

namespace muster::worker {

// One compared line: a field's path (or a name for a resolved value, e.g.
// "device (resolved)") and its value as ConfigToYaml writes it.
using ConfigLine = std::pair<std::string, std::string>;

// The compared lines of `config`, in ConfigFields() order, then `resolved`.
std::vector<ConfigLine> ComparedConfig(const TrainConfig& config,
                                       const std::vector<ConfigLine>& resolved);

// As text ("name: value" a line) and back, for the broadcast.
std::string ConfigLinesText(const std::vector<ConfigLine>& lines);
std::vector<ConfigLine> ParseConfigLines(const std::string& text);

// Where `mine` and `rank0` differ, one "<name> is <mine> here and <rank
// 0's> on rank 0" each, joined by "; ", in `mine`'s order (a name only one
// side has is "missing" on the other); empty when they agree.
std::string ConfigDifferences(const std::vector<ConfigLine>& mine,
                              const std::vector<ConfigLine>& rank0);

// A collective: every rank of `control` calls it with its own lines.
// OK when every rank's equal rank 0's. Otherwise INVALID_ARGUMENT on each
// rank that differs, naming the fields, this rank, its host and `source`
// (its train.yaml), and ABORTED on every other rank, naming the lowest
// rank that differs. A world of one returns OK without communicating.
absl::Status AgreeOnConfig(parallel::Collectives& control, const std::vector<ConfigLine>& mine,
                           const std::string& source);

}  // namespace muster::worker
