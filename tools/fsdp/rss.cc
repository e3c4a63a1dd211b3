#include "tools/fsdp/rss.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"
#include "tools/bench_util.h"

namespace muster::tools {
absl::StatusOr<RssRun> RunRssJob(const RssPaths& paths, const worker::TrainConfig& config,
                                 const std::string& name, int nproc) {
  const std::string base = absl::StrCat(paths.dir, "/", name);
  std::ofstream(base + ".yaml") << worker::ConfigToYaml(config);
  for (int rank = 0; rank < nproc; ++rank) std::remove(absl::StrCat(base, ".rss.", rank).c_str());
  const auto start = std::chrono::steady_clock::now();
  absl::Status ran = RunLogged(
      {paths.launch, "--standalone", absl::StrCat("--nproc_per_node=", nproc), "--no_python",
       paths.self, kRssChildFlag, base + ".rss", paths.worker, base + ".yaml"},
      // 4 ranks of GPT-2 124M on 2 cores are slow.
      base + ".log", absl::Minutes(20), {}, 1500);
  if (!ran.ok()) return ran;
  RssRun run;
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < nproc; ++rank) {
    const std::string file = absl::StrCat(base, ".rss.", rank);
    uint64_t bytes = 0;
    if (std::sscanf(Slurp(file).c_str(), "%" SCNu64, &bytes) != 1) {
      return absl::InternalError(absl::StrCat(file, ": no peak RSS written by rank ", rank));
    }
    run.peak_rss_bytes.push_back(bytes);
  }
  if (config.parallel.strategy != "fsdp") return run;
  run.state_bytes.assign(nproc, 0);
  run.memory_lines.assign(nproc, "");
  for (absl::string_view line : absl::StrSplit(Slurp(base + ".log"), '\n')) {
    const size_t at = line.find("fsdp rank ");
    if (at == absl::string_view::npos) continue;
    const std::string text(line.substr(at));
    int rank = -1;
    unsigned long long params = 0, grads = 0, moments = 0;
    if (std::sscanf(text.c_str(), "fsdp rank %d memory: params %llu B, grads %llu B, moments %llu",
                    &rank, &params, &grads, &moments) != 4 ||
        rank < 0 || rank >= nproc) {
      continue;
    }
    run.state_bytes[rank] = params + grads + moments;
    run.memory_lines[rank] = text;
  }
  for (int rank = 0; rank < nproc; ++rank) {
    if (run.memory_lines[rank].empty()) {
      return absl::InternalError(
          absl::StrCat(base, ".log: no \"fsdp rank ", rank, " memory\" line from the worker"));
    }
  }
  return run;
}

int RssChildMain(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s %s PREFIX PROGRAM [ARGS...]\n", argv[0], kRssChildFlag);
    return 2;
  }
  const char* rank = std::getenv("RANK");
  const std::string out = absl::StrCat(argv[2], ".", rank != nullptr ? rank : "0");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("bench_fsdp: fork");
    return 1;
  }
  if (pid == 0) {
    // Dies with the wrapper, as launch's workers die with launch.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    execv(argv[3], argv + 3);
    std::perror(argv[3]);
    _exit(127);
  }
  int status = 0;
  struct rusage usage = {};
  while (wait4(pid, &status, 0, &usage) < 0) {
    if (errno != EINTR) {
      std::perror("bench_fsdp: wait4");
      return 1;
    }
  }
  // ru_maxrss: kilobytes on Linux.
  if (FILE* file = std::fopen(out.c_str(), "w"); file != nullptr) {
    std::fprintf(file, "%llu\n", static_cast<unsigned long long>(usage.ru_maxrss) * 1024);
    std::fclose(file);
  }
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

}  // namespace muster::tools
