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
  // False when the error file says a restart cannot mend the failure, or
  // when there is none and the worker exited kNotRestartableExitCode.
  bool restartable = true;
  // The file the worker's stderr went to (--redirects, --tee), or "": where
  // the table sends the reader when the worker left no error file.
  std::string stderr_log;
  // Its error report, when it wrote one: the table names it under the row,
  // as torchrun's summary does (the message shown is its first line).
  std::string error_file;
  // False when --local_ranks_filter kept the worker's console lines, and so
  // its stderr unless redirected, off the console.
  bool on_console = true;
};

// What a worker's torch-style error file says:
//   {"message": {"message": "...", "extraInfo": {...}}} or {"message": "..."}
struct ErrorReport {
  // "" if the file is missing or empty, and a note naming the file if it
  // is not JSON of that shape (a worker's bad error file must not hide its
  // failure).
  std::string message;
  // extraInfo's "restartable": "false" (muster's contract, which any
  // worker may use): the failure is its config's or input's, and the job
  // fails at once instead of restarting. Anything else, or no file: true.
  bool restartable = true;
};
ErrorReport ReadErrorFile(const std::string& path);

// What launch writes to its own TORCHELASTIC_ERROR_FILE (set by whoever
// runs it, as TorchX and other schedulers do for torchrun) when the job
// fails: the error file of the failure behind it when a worker left one,
// copied as it is, as torchrun does, else torch's shape with `message`
// and a timestamp: {"message": {"message": "...", "extraInfo":
// {"timestamp": "<unix seconds>"}}}.
std::string ParentErrorReport(const std::string& worker_error_file, const std::string& message,
                              absl::Time when);

// A fixed-width table: time, host, global rank, exit, pid, message.
std::string FormatFailureTable(const std::vector<WorkerFailure>& failures);

}  // namespace muster::launcher
