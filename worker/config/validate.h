// The checks of a TrainConfig once it is read (private to
// //worker/config): every field's own rule (fields.h), then the checks
// across fields, each naming the fields it involves at the line the file
// set the first of them.
#pragma once

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

}  // namespace muster::worker::config_detail
