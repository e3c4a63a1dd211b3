// bench_launch: how fast `launch` starts a job and recovers from a failure,
// next to torchrun on the same machine when /usr/bin/torchrun exists.
//
//   bench_launch [--runs N] [--launch PATH] [--torchrun PATH]
//
// 1. Wall time of a no-op job, `launch --standalone --nproc_per_node=N
//    --no_python true`, for N = 1, 2, 8 (median of --runs), and the same
//    under torchrun with --monitor_interval 0.05 --redirects 1 --tee 1
//    (Debian's torch 1.13 on Python 3.11 crashes with the default
//    redirects).
// 2. Recovery: SIGKILL one of two workers and time until both workers of
//    the restarted round are running.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"
#include "tools/bench_util.h"

namespace {

using muster::launcher::Child;
using muster::launcher::SpawnSpec;
using muster::tools::Slurp;

std::vector<std::string> Environment() {
  std::vector<std::string> env;
  for (const auto& [key, value] : muster::launcher::CurrentEnvironment()) {
    env.push_back(key + "=" + value);
  }
  return env;
}

// Runs argv to completion (output discarded); returns the wall time, or a
// negative duration on failure.
absl::Duration TimeRun(const std::vector<std::string>& argv) {
  SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" >/dev/null 2>&1"};
  spec.argv.insert(spec.argv.end(), argv.begin(), argv.end());
  spec.env = Environment();
  absl::Time start = absl::Now();
  absl::StatusOr<Child> child = Child::Spawn(spec);
  if (!child.ok()) return -absl::Seconds(1);
  auto exit = child->WaitFor(absl::Minutes(2));
  absl::Duration took = absl::Now() - start;
  return exit.has_value() && exit->Succeeded() ? took : -absl::Seconds(1);
}

absl::Duration Median(std::vector<absl::Duration> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// Lines "<restart> <pid> <unix ns>" that workers append at start.
struct Start {
  int restart;
  int pid;
  absl::Time at;
};

std::vector<Start> ReadStarts(const std::string& path) {
  std::vector<Start> starts;
  for (absl::string_view line : absl::StrSplit(Slurp(path), '\n', absl::SkipEmpty())) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ');
    int64_t nanos = 0;
    Start start{};
    if (fields.size() == 3 && absl::SimpleAtoi(fields[0], &start.restart) &&
        absl::SimpleAtoi(fields[1], &start.pid) && absl::SimpleAtoi(fields[2], &nanos)) {
      start.at = absl::FromUnixNanos(nanos);
      starts.push_back(start);
    }
  }
  return starts;
}

// Polls `path` until `count` starts of `restart` are there; the workers
// are other processes' children, so there is no event to wait on.
std::vector<Start> AwaitStarts(const std::string& path, int restart, size_t count,
                               absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::vector<Start> matching;
    for (const Start& start : ReadStarts(path)) {
      if (start.restart == restart) matching.push_back(start);
    }
    if (matching.size() >= count || absl::Now() > deadline) return matching;
    usleep(2000);
  }
}

absl::Duration MeasureRecovery(const std::string& launch) {
  char dir_template[] = "/tmp/bench_launch_XXXXXX";
  std::string dir = mkdtemp(dir_template);
  std::string starts = dir + "/starts";
  SpawnSpec spec;
  spec.argv = {"/bin/sh",
               "-c",
               "exec \"$0\" \"$@\" >/dev/null 2>&1",
               launch,
               "--standalone",
               "--nproc_per_node=2",
               "--max_restarts=1",
               "--shutdown_timeout=5",
               "--no_python",
               "/bin/sh",
               "-c",
               "echo $TORCHELASTIC_RESTART_COUNT $$ $(date +%s%N) >> " + starts +
                   "; [ $TORCHELASTIC_RESTART_COUNT = 1 ] && exit 0; exec sleep 60"};
  spec.env = Environment();
  absl::StatusOr<Child> agent = Child::Spawn(spec);
  absl::Duration recovery = -absl::Seconds(1);
  if (agent.ok()) {
    std::vector<Start> first = AwaitStarts(starts, 0, 2, absl::Seconds(30));
    if (first.size() == 2) {
      absl::Time killed = absl::Now();
      kill(first[0].pid, SIGKILL);
      std::vector<Start> second = AwaitStarts(starts, 1, 2, absl::Seconds(30));
      if (second.size() == 2) {
        recovery = std::max(second[0].at, second[1].at) - killed;
      }
    }
    agent->WaitFor(absl::Seconds(30));
  }
  std::filesystem::remove_all(dir);
  return recovery;
}

std::string Ms(absl::Duration duration) {
  if (duration < absl::ZeroDuration()) return "failed";
  return absl::StrCat(absl::ToDoubleMilliseconds(duration), " ms");
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 7;
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string launch =
      (std::filesystem::path(self).parent_path().parent_path() / "launcher" / "launch").string();
  std::string torchrun = "/usr/bin/torchrun";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--runs") {
      if (!absl::SimpleAtoi(argv[i + 1], &runs) || runs < 1) {
        std::fprintf(stderr, "bench_launch: --runs expects a positive integer\n");
        return 2;
      }
    } else if (flag == "--launch") {
      launch = argv[i + 1];
    } else if (flag == "--torchrun") {
      torchrun = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: bench_launch [--runs N] [--launch PATH] [--torchrun PATH]\n");
      return 2;
    }
  }
  if (access(launch.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "bench_launch: no launch binary at %s (use --launch)\n", launch.c_str());
    return 2;
  }
  bool have_torchrun = access(torchrun.c_str(), X_OK) == 0;
  int torch_runs = std::max(1, std::min(runs, 3));  // torchrun takes seconds a run

  std::printf("no-op job wall time (median of %d runs; torchrun %d runs)\n", runs, torch_runs);
  std::printf("%6s %14s %14s %8s\n", "nproc", "launch", "torchrun", "ratio");
  int status = 0;
  for (int nproc : {1, 2, 8}) {
    std::vector<absl::Duration> ours;
    for (int run = 0; run < runs; ++run) {
      ours.push_back(TimeRun({launch, "--standalone", absl::StrCat("--nproc_per_node=", nproc),
                              "--no_python", "true"}));
    }
    absl::Duration our_median = Median(ours);
    if (our_median < absl::ZeroDuration()) status = 1;
    std::string theirs_text = "-", ratio_text = "-";
    if (have_torchrun) {
      std::vector<absl::Duration> theirs;
      for (int run = 0; run < torch_runs; ++run) {
        theirs.push_back(
            TimeRun({torchrun, "--standalone", absl::StrCat("--nproc_per_node=", nproc),
                     "--monitor_interval", "0.05", "--redirects", "1", "--tee", "1", "--no_python",
                     "true"}));
      }
      absl::Duration their_median = Median(theirs);
      theirs_text = Ms(their_median);
      if (their_median > absl::ZeroDuration() && our_median > absl::ZeroDuration()) {
        ratio_text = absl::StrCat(absl::FDivDuration(their_median, our_median), "x");
      }
    }
    std::printf("%6d %14s %14s %8s\n", nproc, Ms(our_median).c_str(), theirs_text.c_str(),
                ratio_text.c_str());
  }
  if (!have_torchrun) std::printf("(no %s: torchrun not measured)\n", torchrun.c_str());

  std::vector<absl::Duration> recoveries;
  for (int run = 0; run < std::min(runs, 5); ++run) recoveries.push_back(MeasureRecovery(launch));
  absl::Duration recovery = Median(recoveries);
  if (recovery < absl::ZeroDuration()) status = 1;
  std::printf(
      "recovery after SIGKILL of one of 2 workers, until both restarted workers run "
      "(median of %zu): %s\n",
      recoveries.size(), Ms(recovery).c_str());
  return status;
}
