// Peak resident memory per rank for tools/bench_fsdp: the real `worker`
// as N processes under the real `launch --standalone`.
//
// launch runs an executable target itself (--no_python), so each rank is
// this benchmark's own binary in its wrapper mode (RssChildMain) running
// `worker <yaml>` as its child: the wrapper waits for it with wait4 and
// writes the child's ru_maxrss (the kernel's peak RSS of the worker, its
// VmHWM at exit) to a file per rank. The wrapper's own memory is not in it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/config/config.h"

namespace muster::tools {

struct RssPaths {
  std::string launch;  // launcher/launch
  std::string worker;  // worker/worker
  std::string self;    // this benchmark (the wrapper)
  std::string dir;     // scratch: data, yaml, logs, the per-rank files
};

struct RssRun {
  std::vector<uint64_t> peak_rss_bytes;  // per rank
  // Per rank, from the worker's "fsdp rank R memory: ..." line (FSDP
  // only; empty under DDP): params + grads + moments as the worker
  // counted them, and the line itself.
  std::vector<uint64_t> state_bytes;
  std::vector<std::string> memory_lines;
  double seconds = 0;  // wall time of the whole job
};

// Trains `config` (data.train, train.steps, parallel.* set by the caller)
// with `nproc` ranks under launch. Errors quote the launch log's tail.
absl::StatusOr<RssRun> RunRssJob(const RssPaths& paths, const worker::TrainConfig& config,
                                 const std::string& name, int nproc);

// The wrapper mode: `<self> --rss-child <prefix> <program> [args...]` runs
// the program as a child, writes "<peak RSS bytes>\n" to <prefix>.<RANK>
// when it exits (RANK from the environment launch gives), and exits as it
// did. The first flag of a command line that selects it.
inline constexpr char kRssChildFlag[] = "--rss-child";
int RssChildMain(int argc, char** argv);

}  // namespace muster::tools
