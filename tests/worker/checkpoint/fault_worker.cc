// fault_worker: the `worker` program (worker/worker_main.h) on a file
// system that stops a checkpoint save at a chosen phase, so a test can
// SIGKILL the process there (checkpoint_process_test.cc).
//
//   fault_worker --pause_at=<phase>[@<step>] --pause_marker=<file> <worker args>...
//
// A save (of step <step>, or of any step) blocks at the first file-system
// call of <phase>, after creating <file>:
//   data      the first Append to a rank's data file writes half of its
//             bytes, then blocks: the file is half written (the writer
//             hands a file's data to one Append, worker/checkpoint/files.h);
//   manifest  the creation of manifest.json: every rank file is durable,
//             there is no manifest yet;
//   rename    the rename of .tmp_step_N to step_N: the manifest is durable,
//             the directory not yet renamed.
// The block is bounded: after 120 s the call fails with DEADLINE_EXCEEDED
// rather than hang a test run. The two flags are removed from the
// arguments the worker sees; without --pause_at nothing is paused.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/manifest.h"
#include "worker/worker_main.h"

namespace muster::worker {
namespace {

constexpr int kExitUsage = 2;

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

// The step of a save's temporary directory name (".tmp_step_00000008").
std::optional<int> TempDirStep(const std::string& name) {
  const std::string prefix = ".tmp_";
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  return ParseStepDirName(name.substr(prefix.size()));
}

class PausingEnv : public EnvWrapper {
 public:
  // `step` < 0: a save of any step.
  PausingEnv(Env* target, std::string phase, int step, std::string marker)
      : EnvWrapper(target), phase_(std::move(phase)), step_(step), marker_(std::move(marker)) {}

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    const std::string name = BaseName(path);
    if (phase_ == "manifest" && name == kManifestName && InSave(Parent(path))) {
      if (absl::Status paused = Pause(); !paused.ok()) return paused;
    }
    auto file = target()->NewWritableFile(path);
    if (!file.ok() || phase_ != "data" || !InSave(Parent(path))) return file;
    if (!absl::StartsWith(name, "rank_") || !absl::EndsWith(name, ".bin")) return file;
    return std::unique_ptr<WritableFile>(new HalfThenPause(this, *std::move(file)));
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (phase_ == "rename" && InSave(from)) {
      if (absl::Status paused = Pause(); !paused.ok()) return paused;
    }
    return target()->RenameFile(from, to);
  }

 private:
  // A rank file whose first Append stops half way.
  class HalfThenPause : public WritableFile {
   public:
    HalfThenPause(PausingEnv* env, std::unique_ptr<WritableFile> file)
        : env_(env), file_(std::move(file)) {}
    absl::Status Append(const void* data, size_t bytes) override {
      if (env_->paused_.load()) return file_->Append(data, bytes);
      const size_t half = bytes / 2;
      if (absl::Status status = file_->Append(data, half); !status.ok()) return status;
      if (absl::Status paused = env_->Pause(); !paused.ok()) return paused;
      return file_->Append(static_cast<const char*>(data) + half, bytes - half);
    }
    absl::Status Sync() override { return file_->Sync(); }
    absl::Status Close() override { return file_->Close(); }

   private:
    PausingEnv* env_;
    std::unique_ptr<WritableFile> file_;
  };

  // Whether `dir` is the temporary directory of a save to pause.
  bool InSave(const std::string& dir) const {
    auto step = TempDirStep(BaseName(dir));
    return step.has_value() && (step_ < 0 || *step == step_);
  }

  // Creates the marker and waits to be killed: nothing can announce a
  // SIGKILL, so this is the one place that sleeps, once, bounded. Later
  // calls (another rank's thread, a second save) pass through.
  absl::Status Pause() {
    if (paused_.exchange(true)) return absl::OkStatus();
    if (!marker_.empty()) std::ofstream(marker_) << phase_ << "\n";
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return absl::DeadlineExceededError(
        absl::StrCat("fault_worker --pause_at=", phase_, ": paused 120 s and was not killed"));
  }

  const std::string phase_;
  const int step_;
  const std::string marker_;
  std::atomic<bool> paused_{false};
};

int Main(int argc, char** argv) {
  const std::string kPauseAt = "--pause_at=", kMarker = "--pause_marker=";
  std::string pause_at, marker;
  std::vector<char*> worker_argv;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i > 0 && absl::StartsWith(arg, kPauseAt)) {
      pause_at = arg.substr(kPauseAt.size());
    } else if (i > 0 && absl::StartsWith(arg, kMarker)) {
      marker = arg.substr(kMarker.size());
    } else {
      worker_argv.push_back(argv[i]);
    }
  }
  worker_argv.push_back(nullptr);
  const int worker_argc = static_cast<int>(worker_argv.size()) - 1;
  if (pause_at.empty()) return WorkerMain(worker_argc, worker_argv.data(), Env::Default());

  std::vector<std::string> parts = absl::StrSplit(pause_at, absl::MaxSplits('@', 1));
  const std::string& phase = parts[0];
  int step = -1;
  if ((phase != "data" && phase != "manifest" && phase != "rename") ||
      (parts.size() == 2 && (!absl::SimpleAtoi(parts[1], &step) || step < 0))) {
    std::fprintf(stderr,
                 "fault_worker: --pause_at=%s: expected data, manifest or rename, optionally "
                 "@<step>\n",
                 pause_at.c_str());
    return kExitUsage;
  }
  PausingEnv env(Env::Default(), phase, step, marker);
  return WorkerMain(worker_argc, worker_argv.data(), &env);
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) {
  // With the original arguments: the re-exec must see the flags too.
  muster::worker::HoldPreemptionSignals();
  muster::worker::WaitPassivelyUnlessChosen(argv);
  return muster::worker::Main(argc, argv);
}
