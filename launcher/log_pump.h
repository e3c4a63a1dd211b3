// Copies worker output from pipes to log files and to the agent's console.
//
// One thread serves every pipe with poll(), so N workers cost one thread.
// Console lines carry a prefix naming the node and the global rank
// ("[node1 rank5]: "), written with one write() per line so lines of
// different workers never interleave mid-line. Files get the bytes as they
// came.
//
// Thread-safety: Add and WaitDrained may be called from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/time/time.h"

namespace muster::launcher {

struct LogSink {
  int file_fd = -1;        // log file to append to (owned by the pump), or -1
  int console_fd = -1;     // STDOUT_FILENO / STDERR_FILENO (not owned), or -1
  std::string prefix;      // put before each console line
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
