// Helpers for tests that run the real `launch` and `rendezvous` binaries as
// processes on 127.0.0.1.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "launcher/process.h"
#include "tools/server_process.h"

namespace muster::testing {

// Path of a binary built by Bazel and listed in the test's `data`, e.g.
// "launcher/launch".
std::string BinaryPath(const std::string& workspace_relative);
// Path of any file in the test's runfiles (data files, scripts).
std::string RunfilePath(const std::string& workspace_relative);

// A fresh directory, removed when the object goes.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Polls `condition` every 10 ms until it holds or `timeout` passes. For
// conditions no event announces (files written by other processes, /proc).
bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout);

std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& text);
// Lines of every regular file in `dir` whose name starts with `prefix`.
std::vector<std::string> ReadLines(const std::string& dir, const std::string& prefix);

// True once `pid` is gone or a zombie.
bool ProcessGone(int pid);

// The pid of a live child of `parent` for which `match(pid)` holds, or -1.
int FindChild(int parent, const std::function<bool(int pid)>& match);
// A process's command name (/proc/PID/comm), "" once it is gone.
std::string ProcessName(int pid);
// Whether a process's environment holds exactly `entry`, e.g. "RANK=1".
bool HasEnvironmentEntry(int pid, const std::string& entry);

// step -> the loss as written in a worker's metrics JSONL (eval lines
// skipped). A step written twice keeps its last record.
std::map<int, std::string> LossTexts(const std::string& metrics_path);
// The same, as numbers.
std::map<int, double> Losses(const std::string& metrics_path);
// The steps of a metrics JSONL's step lines, in file order (eval lines
// skipped): a resumed run cuts the file back to its checkpoint's step, so
// a run killed and resumed logs each step once, as one never killed does.
std::vector<int> LoggedSteps(const std::string& metrics_path);

// A `rendezvous` server child on a free loopback port (REQUIREs it starts).
std::unique_ptr<tools::ServerProcess> StartServer(const std::vector<std::string>& extra_args = {});

// Starts `launch` with `args`; stdout and stderr go to `log_path`, or
// stderr to `stderr_path` when that is given.
launcher::Child StartLaunch(const std::vector<std::string>& args, const std::string& log_path,
                            const std::vector<std::string>& extra_env = {},
                            const std::string& stderr_path = "");

}  // namespace muster::testing
