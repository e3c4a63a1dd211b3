#include "tests/launcher/harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/worker_env.h"

namespace muster::testing {

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  std::string path = absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "muster", "/",
                                  workspace_relative);
  REQUIRE(access(path.c_str(), R_OK) == 0);
  return path;
}

std::string BinaryPath(const std::string& workspace_relative) {
  std::string path = RunfilePath(workspace_relative);
  REQUIRE(access(path.c_str(), X_OK) == 0);
  return path;
}

TempDir::TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base ? base : "/tmp", "/muster_test_XXXXXX");
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    usleep(10000);
  }
  return true;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary);
    out << text;
  }
  std::filesystem::rename(temporary, path);
}

std::vector<std::string> ReadLines(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> lines;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name.rfind(prefix, 0) != 0) continue;
    for (absl::string_view line : absl::StrSplit(ReadFile(entry.path()), '\n', absl::SkipEmpty())) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

bool ProcessGone(int pid) {
  std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  if (stat.empty()) return true;
  size_t close_paren = stat.rfind(')');
  return close_paren != std::string::npos && stat.size() > close_paren + 2 &&
         stat[close_paren + 2] == 'Z';
}

int FindChild(int parent, const std::function<bool(int pid)>& match) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    std::string status = ReadFile(entry.path().string() + "/status");
    size_t at = status.find("PPid:\t");
    int ppid = 0;
    if (at == std::string::npos ||
        !absl::SimpleAtoi(status.substr(at + 6, status.find('\n', at) - at - 6), &ppid) ||
        ppid != parent || ProcessGone(pid)) {
      continue;
    }
    if (match(pid)) return pid;
  }
  return -1;
}

std::string ProcessName(int pid) {
  return std::string(
      absl::StripTrailingAsciiWhitespace(ReadFile(absl::StrCat("/proc/", pid, "/comm"))));
}

bool HasEnvironmentEntry(int pid, const std::string& entry) {
  for (absl::string_view var :
       absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/environ")), '\0')) {
    if (var == entry) return true;
  }
  return false;
}

namespace {

// The step lines of a metrics JSONL, in file order: (step, loss as
// written). {"step":N,"loss":X,...}; eval lines have "val_loss" instead.
std::vector<std::pair<int, std::string>> StepLines(const std::string& metrics_path) {
  std::vector<std::pair<int, std::string>> lines;
  for (absl::string_view line : absl::StrSplit(ReadFile(metrics_path), '\n', absl::SkipEmpty())) {
    size_t s = line.find("\"step\":"), l = line.find("\"loss\":");
    int step = 0;
    if (s == absl::string_view::npos || l == absl::string_view::npos ||
        !absl::SimpleAtoi(line.substr(s + 7, line.find(',', s) - s - 7), &step)) {
      continue;
    }
    lines.emplace_back(step, std::string(line.substr(l + 7, line.find(',', l) - l - 7)));
  }
  return lines;
}

}  // namespace

std::map<int, std::string> LossTexts(const std::string& metrics_path) {
  std::map<int, std::string> losses;
  for (auto& [step, loss] : StepLines(metrics_path)) losses[step] = std::move(loss);
  return losses;
}

std::vector<int> LoggedSteps(const std::string& metrics_path) {
  std::vector<int> steps;
  for (const auto& line : StepLines(metrics_path)) steps.push_back(line.first);
  return steps;
}

std::map<int, double> Losses(const std::string& metrics_path) {
  std::map<int, double> losses;
  for (const auto& [step, text] : LossTexts(metrics_path)) {
    double loss = 0;
    REQUIRE(absl::SimpleAtod(text, &loss));
    losses[step] = loss;
  }
  return losses;
}

std::unique_ptr<tools::ServerProcess> StartServer(const std::vector<std::string>& extra_args) {
  tools::ServerProcessOptions options;
  options.binary = BinaryPath("rendezvous/rendezvous");
  // Quiet unless the test asks for a level (to wait for an info line).
  if (std::find(extra_args.begin(), extra_args.end(), "--log-level") == extra_args.end()) {
    options.extra_args = {"--log-level", "warn"};
  }
  options.extra_args.insert(options.extra_args.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<std::unique_ptr<tools::ServerProcess>> server =
      tools::ServerProcess::Start(options);
  INFO(server.status().ToString());
  REQUIRE(server.ok());
  return *std::move(server);
}

launcher::Child StartLaunch(const std::vector<std::string>& args, const std::string& log_path,
                            const std::vector<std::string>& extra_env,
                            const std::string& stderr_path) {
  // `launch` runs through a shell only to send its output to files.
  std::string command =
      "exec \"$0\" \"$@\" >>" + log_path + (stderr_path.empty() ? " 2>&1" : " 2>>" + stderr_path);
  launcher::SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c", command, BinaryPath("launcher/launch")};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  // `extra_env` replaces a variable of this process's environment of the
  // same name (a variable given twice is read as the first by some
  // programs and as the last by others).
  std::map<std::string, std::string> env = launcher::CurrentEnvironment();
  for (const std::string& entry : extra_env) {
    const size_t equals = entry.find('=');
    env[entry.substr(0, equals)] = equals == std::string::npos ? "" : entry.substr(equals + 1);
  }
  for (const auto& [key, value] : env) spec.env.push_back(key + "=" + value);
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  return std::move(*child);
}

}  // namespace muster::testing
