#include "launcher/workers.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

constexpr int kStdoutBit = 1;
constexpr int kStderrBit = 2;

bool IsExecutable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

std::string FindOnPath(const std::string& name, const std::map<std::string, std::string>& env) {
  auto path = env.find("PATH");
  if (path == env.end()) return "";
  for (absl::string_view dir : absl::StrSplit(path->second, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", name);
    if (IsExecutable(candidate)) return candidate;
  }
  return "";
}

int OpenLog(const std::string& path) {
  return open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

// Whether the agent runs in the foreground of the terminal its stdin is: a
// user at a shell. Workers then stay in the agent's process group, as
// torchrun's do, so one can read that terminal (input(), pdb at rank 0);
// in a group of their own they would be stopped by SIGTTIN when they read
// it, and the job would hang without a word.
bool AtTheTerminal() {
  if (isatty(STDIN_FILENO) != 1) return false;
  const pid_t foreground = tcgetpgrp(STDIN_FILENO);
  return foreground > 0 && foreground == getpgrp();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> WorkerCommand(
    const LaunchOptions& options, const std::map<std::string, std::string>& env) {
  std::vector<std::string> command;
  switch (options.target_kind) {
    case TargetKind::kYamlConfig: {
      std::error_code error;
      std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
      std::vector<std::string> candidates;
      if (!error) {
        candidates.push_back((self.parent_path() / "worker").string());
        candidates.push_back((self.parent_path().parent_path() / "worker" / "worker").string());
      }
      std::string found;
      for (const std::string& candidate : candidates) {
        if (IsExecutable(candidate)) {
          found = candidate;
          break;
        }
      }
      if (found.empty()) found = FindOnPath("worker", env);
      if (found.empty()) {
        return absl::NotFoundError(absl::StrCat("cannot find the `worker` binary to run ",
                                                options.target,
                                                ": looked next to launch and on PATH"));
      }
      command = {found, options.target};
      break;
    }
    case TargetKind::kPythonScript: {
      auto python = env.find("PYTHON_EXEC");
      command = {python != env.end() ? python->second : "python3", "-u"};
      if (options.run_module) command.push_back("-m");
      command.push_back(options.target);
      break;
    }
    case TargetKind::kExecutable:
      // Without --no_python the target is the file of that name here (it
      // was found so): named as a path, or the exec would search PATH and
      // run /usr/bin/test for ./test. --no_python names a program as
      // torchrun's does, found on PATH.
      command = {options.no_python || options.target.find('/') != std::string::npos
                     ? options.target
                     : "./" + options.target};
      break;
  }
  if (options.target_kind != TargetKind::kExecutable && !options.run_module &&
      access(options.target.c_str(), R_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("target ", options.target, " is not readable"));
  }
  command.insert(command.end(), options.target_args.begin(), options.target_args.end());
  return command;
}

absl::StatusOr<std::unique_ptr<WorkerGroup>> WorkerGroup::Start(const WorkerGroupSpec& spec,
                                                                LogPump* pump) {
  auto group = std::unique_ptr<WorkerGroup>(new WorkerGroup());
  group->host_ = spec.host;
  for (int local_rank = 0; local_rank < spec.round.local_world_size; ++local_rank) {
    int global_rank = spec.round.rank_offset + local_rank;
    std::string dir = absl::StrCat(spec.attempt_dir, "/", global_rank);
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    // A log directory that cannot be made (a full disk, say) costs the
    // rank its error file and log files, not the job: it runs without them
    // (an empty TORCHELASTIC_ERROR_FILE, as torch reads it, is none), and
    // the pump shows its redirected streams on the console instead.
    std::string error_file;
    if (error) {
      spdlog::warn(
          "cannot create the log directory {}: {}; rank {} runs without its error file and log "
          "files",
          dir, error.message(), global_rank);
    } else {
      error_file = dir + "/error.json";
      unlink(error_file.c_str());  // a stale report must not blame this attempt
    }

    SpawnSpec process;
    process.argv = spec.command;
    process.env = WorkerEnvironment(spec.base_env, spec.round, spec.access, local_rank, error_file);
    process.pipe_stdout = process.pipe_stderr = true;
    process.blocked_signals = spec.blocked_signals;
    process.own_process_group = !AtTheTerminal();
    absl::StatusOr<Child> child = Child::Spawn(process);
    if (!child.ok()) {
      group->Stop(absl::Seconds(5), SIGTERM);
      return child.status();
    }

    bool on_console =
        spec.local_ranks_filter.empty() ||
        std::count(spec.local_ranks_filter.begin(), spec.local_ranks_filter.end(), local_rank) > 0;
    int redirects = StreamsFor(spec.redirects, local_rank);
    int tee = StreamsFor(spec.tee, local_rank);
    std::string prefix = absl::StrCat("[", spec.host, " rank", global_rank, "]: ");
    std::string stderr_log;
    for (auto [bit, fd, console, name] :
         {std::tuple{kStdoutBit, child->TakeStdout(), STDOUT_FILENO, "stdout.log"},
          std::tuple{kStderrBit, child->TakeStderr(), STDERR_FILENO, "stderr.log"}}) {
      LogSink sink;
      bool to_file = (redirects & bit) || (tee & bit);
      if (to_file) {
        sink.file_path = absl::StrCat(dir, "/", name);
        sink.file_fd = OpenLog(sink.file_path);
        sink.file_error = errno;
        if (bit == kStderrBit && sink.file_fd >= 0) stderr_log = sink.file_path;
      }
      // Redirected without tee: file only, as torchrun does, unless the
      // file fails (the pump then shows it here rather than lose it).
      if (on_console) {
        const bool file_only = (redirects & bit) && !(tee & bit);
        if (file_only) {
          sink.fallback_console_fd = console;
        } else {
          sink.console_fd = console;
        }
        sink.prefix = prefix;
      }
      pump->Add(fd, std::move(sink));
    }
    group->workers_.push_back(
        Worker{std::move(*child), local_rank, global_rank, error_file, stderr_log, on_console});
  }
  return group;
}

WorkerGroup::~WorkerGroup() { Stop(absl::ZeroDuration(), SIGKILL); }

std::vector<int> WorkerGroup::RunningPidfds() const {
  std::vector<int> fds;
  for (const Worker& worker : workers_) {
    if (worker.child.running()) fds.push_back(worker.child.pidfd());
  }
  return fds;
}

void WorkerGroup::CollectExits() {
  for (Worker& worker : workers_) {
    std::optional<ExitInfo> exit = worker.child.CheckExit();
    if (!exit.has_value() || exit->Succeeded() || worker.reported) continue;
    worker.reported = true;
    ErrorReport report = ReadErrorFile(worker.error_file);
    // No error file, and the exit code that says what it would have.
    if (report.message.empty() && exit->signal == 0 && exit->exit_code == kNotRestartableExitCode) {
      report.restartable = false;
    }
    const std::string error_file = report.message.empty() ? "" : worker.error_file;
    failures_.push_back(WorkerFailure{absl::Now(), host_, worker.global_rank, worker.local_rank,
                                      worker.child.pid(), *exit, std::move(report.message),
                                      report.restartable, worker.stderr_log, error_file,
                                      worker.on_console});
  }
}

void WorkerGroup::AwaitExits(absl::Time deadline) {
  for (Worker& worker : workers_) {
    if (worker.child.running()) {
      worker.child.WaitFor(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    }
  }
  CollectExits();
}

int WorkerGroup::running() const {
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(),
                                        [](const Worker& w) { return w.child.running(); }));
}

bool WorkerGroup::all_succeeded() const {
  return std::all_of(workers_.begin(), workers_.end(), [](const Worker& worker) {
    return worker.child.exit_info().has_value() && worker.child.exit_info()->Succeeded();
  });
}

bool WorkerGroup::preempted() const {
  bool saved = false;
  for (const Worker& worker : workers_) {
    const std::optional<ExitInfo>& exit = worker.child.exit_info();
    if (!exit.has_value()) return false;
    if (exit->signal == 0 && exit->exit_code == kPreemptedExitCode) {
      saved = true;
    } else if (!exit->Succeeded()) {
      return false;
    }
  }
  return saved;
}

std::string WorkerGroup::DescribeExits() const {
  std::string text;
  for (const Worker& worker : workers_) {
    const std::optional<ExitInfo>& exit = worker.child.exit_info();
    absl::StrAppend(&text, text.empty() ? "" : "; ", "rank ", worker.global_rank, ": ",
                    exit.has_value() ? exit->Describe() : "running");
  }
  return text;
}

void WorkerGroup::Stop(absl::Duration timeout, int signal) {
  // A worker that has ended takes what it left running in its process
  // group with it (docs/launch.md): say so, or a background uploader is
  // lost without a word.
  for (Worker& worker : workers_) {
    if (worker.child.running() || worker.warned_leftovers) continue;
    std::vector<pid_t> left = worker.child.OthersInGroup();
    if (left.empty()) continue;
    worker.warned_leftovers = true;
    spdlog::warn(
        "rank {} ended with {} process(es) of its own still running (pid {}); they end with it "
        "(a background job must finish before its worker exits)",
        worker.global_rank, left.size(), absl::StrJoin(left, ", "));
  }
  std::vector<Child*> children;
  for (Worker& worker : workers_) children.push_back(&worker.child);
  StopAll(children, timeout, signal);
}

}  // namespace muster::launcher
