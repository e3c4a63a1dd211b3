// A train.yaml's bytes, as LoadConfig reads them (private to
// //worker/config).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace muster::worker::config_detail {

// Reads the config file at `path`: a regular file, or a pipe being written
// (`worker <(sed 's/4/8/' train.yaml)`), read to its end. Never waits on
// a FIFO that nothing writes to, which an open(2) for reading would do
// forever.
//
// Errors:
//   NOT_FOUND         "PATH: cannot read the config file: REASON", the
//                     reason as strerror says it (No such file or
//                     directory, Permission denied, Too many levels of
//                     symbolic links);
//   INVALID_ARGUMENT  "PATH: ..., not a config file": a directory, a
//                     device, a socket, a FIFO that nothing writes to, or
//                     more than 1 MiB.
absl::StatusOr<std::string> ReadConfigFile(const std::string& path);

}  // namespace muster::worker::config_detail
