// The failure report an agent prints when workers fail: one row per failed
// worker, with the message it left in its TORCHELASTIC_ERROR_FILE.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "launcher/process.h"

namespace muster::launcher {

struct WorkerFailure {
  absl::Time time;
  std::string host;
  int global_rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  ExitInfo exit;
  std::string message;  // from the error file, or "" if it wrote none
};

// Reads the message from a torch-style error file:
//   {"message": {"message": "...", "extraInfo": {...}}} or {"message": "..."}
// Returns "" if the file is missing or empty, and a note naming the file if
// it is not JSON of that shape (a worker's bad error file must not hide its
// failure).
std::string ReadErrorFileMessage(const std::string& path);

// A fixed-width table: time, host, global rank, exit, pid, message.
std::string FormatFailureTable(const std::vector<WorkerFailure>& failures);

}  // namespace muster::launcher
