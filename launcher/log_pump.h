// Copies worker output from pipes to log files and to the agent's console.
//
// One thread serves every pipe with poll(), so N workers cost one thread.
// Console lines carry a prefix naming the node and the global rank
// ("[node1 rank5]: "), and the whole lines of one read go out in one
// write(), so lines of different workers never interleave mid-line. A line
// ends with '\n' or '\r': each redraw of a progress bar (tqdm writes
// "\r 42%|####") is shown with its prefix, and the terminal still draws
// it in place. Text longer than kMaxConsoleLine without a line end is
// shown in pieces, so the pump holds at most that much per stream and
// scans each byte once. Files get the bytes as they came.
//
// A log file that cannot be opened or written (a full disk) is given up
// with one warning on the agent's log naming it and the reason; a stream
// redirected to it alone is shown on the console from then on instead,
// prefixed as usual. Only a stream kept off the console by the ranks'
// filter is then lost, and the warning says so.
//
// Thread-safety: Add and WaitDrained may be called from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/time/time.h"

namespace muster::launcher {

// The longest console line: text that goes on longer without a line end
// is shown in pieces of this size, each ended with a newline.
inline constexpr size_t kMaxConsoleLine = 64 * 1024;

struct LogSink {
  int file_fd = -1;     // log file to append to (owned by the pump), or -1
  int console_fd = -1;  // STDOUT_FILENO / STDERR_FILENO (not owned), or -1
  std::string prefix;   // put before each console line
  // The log file's path, when there is one: file_fd, or -1 with the errno
  // of its failed open in file_error.
  std::string file_path;
  int file_error = 0;
  // The console a stream kept off it (redirected to its file only) is
  // shown on if its file fails, so that its output is not lost; -1: none.
  int fallback_console_fd = -1;
};

class LogPump {
 public:
  LogPump();
  ~LogPump();  // stops the thread; closes every fd it owns
  LogPump(const LogPump&) = delete;
  LogPump& operator=(const LogPump&) = delete;

  // Takes ownership of `read_fd` and of sink.file_fd.
  void Add(int read_fd, LogSink sink);

  // True once every pipe added so far reached end of file (its writers
  // exited) and its output was written; false if `timeout` passed first.
  bool WaitDrained(absl::Duration timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::launcher
