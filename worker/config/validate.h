// The checks of a TrainConfig once it is read (private to
// //worker/config): every field's own rule (fields.h), then the checks
// across fields, each naming the fields it involves at the line the file
// set the first of them.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "worker/config/config.h"
#include "worker/config/reader.h"

namespace muster::worker::config_detail {

// Every impossible value, checked after reading so that checks across
// fields see the final values whatever order the file wrote them in. Each
// field's own checks come first, in table order (so the checks across
// fields see values that are each possible, heads > 0 among them).
// INVALID_ARGUMENT from `reader`'s Error for the first one found.
absl::Status Validate(const TrainConfig& config, const ConfigReader& reader);

// The checks that read the file system, on the resolved paths: a
// train.metrics_file that is `config_file` itself (may be empty: none), a
// file data.train or data.val matches, or checkpoint.dir or a file in it.
// The metrics file is truncated when a run starts, so any of these would
// destroy what it names (a shard, the config, the LOCK).
absl::Status ValidatePaths(const TrainConfig& config, const ConfigReader& reader,
                           const std::string& config_file);

}  // namespace muster::worker::config_detail
