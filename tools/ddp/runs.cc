#include "tools/ddp/runs.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"
#include "tools/bench_util.h"
#include "worker/data/data.h"

namespace muster::tools {
namespace {

constexpr char kPython[] = "/usr/bin/python3";        // Debian's, with python3-torch
constexpr absl::Duration kLimit = absl::Minutes(10);  // one job

// Throughput over the steps after `warmup` in a metrics JSONL.
absl::StatusOr<Throughput> FromMetrics(const std::string& path, int warmup) {
  Throughput result;
  double tokens = 0, ms = 0;
  for (absl::string_view line : absl::StrSplit(Slurp(path), '\n', absl::SkipEmpty())) {
    int step = 0;
    double loss, lr, norm, step_ms, tokens_per_s;
    if (std::sscanf(std::string(line).c_str(),
                    "{\"step\":%d,\"loss\":%lf,\"lr\":%lf,\"grad_norm\":%lf,\"ms\":%lf,"
                    "\"tokens_per_s\":%lf",
                    &step, &loss, &lr, &norm, &step_ms, &tokens_per_s) != 6 ||
        step <= warmup) {
      continue;
    }
    tokens += tokens_per_s * step_ms / 1e3;
    ms += step_ms;
    ++result.steps;
  }
  if (result.steps == 0 || ms <= 0) {
    return absl::InternalError(absl::StrCat(path, ": no step after warm-up step ", warmup));
  }
  result.tokens_per_s = tokens / (ms / 1e3);
  result.ms_per_step = ms / result.steps;
  return result;
}

}  // namespace

absl::Status WriteBenchData(const std::string& dir, int vocab) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  std::vector<uint16_t> tokens(1 << 20);
  for (uint16_t& value : tokens) value = static_cast<uint16_t>(token(rng));
  return worker::WriteTokenShard(dir + "/train_000.bin", tokens);
}

absl::StatusOr<Throughput> RunWorkerJob(const JobPaths& paths, worker::TrainConfig config,
                                        int nproc, int warmup, int steps) {
  const std::string name = absl::StrCat(paths.dir, "/worker_", nproc);
  config.data.train = paths.dir + "/train_*.bin";
  config.train.steps = warmup + steps;
  config.train.log_every = 1;
  config.train.eval_every = 0;
  config.train.metrics_file = name + ".jsonl";
  std::remove(config.train.metrics_file.c_str());
  std::ofstream(name + ".yaml") << worker::ConfigToYaml(config);
  absl::Status ran =
      nproc == 1
          ? RunLogged({paths.worker, name + ".yaml"}, name + ".log", kLimit, {"OMP_NUM_THREADS=1"})
          : RunLogged({paths.launch, "--standalone", absl::StrCat("--nproc_per_node=", nproc),
                       name + ".yaml"},
                      name + ".log", kLimit);
  if (!ran.ok()) return ran;
  return FromMetrics(config.train.metrics_file, warmup);
}

absl::StatusOr<Throughput> RunTorchDdpJob(const JobPaths& paths, const std::string& script,
                                          const worker::TrainConfig& config, int nproc, int warmup,
                                          int steps) {
  if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    return absl::NotFoundError(absl::StrCat(kPython, " cannot import torch"));
  }
  const std::string name = absl::StrCat(paths.dir, "/torch_", nproc);
  const worker::ModelConfig& m = config.model;
  std::remove((name + ".out").c_str());
  absl::Status ran = RunLogged({paths.launch,
                                "--standalone",
                                absl::StrCat("--nproc_per_node=", nproc),
                                "--no_python",
                                kPython,
                                script,
                                "--layers",
                                absl::StrCat(m.layers),
                                "--dim",
                                absl::StrCat(m.dim),
                                "--heads",
                                absl::StrCat(m.heads),
                                "--vocab",
                                absl::StrCat(m.vocab),
                                "--seq",
                                absl::StrCat(m.seq_len),
                                "--batch",
                                absl::StrCat(config.data.micro_batch),
                                "--steps",
                                absl::StrCat(steps),
                                "--warmup",
                                absl::StrCat(warmup),
                                "--bucket_mb",
                                absl::StrCat(config.parallel.bucket_mb),
                                "--out",
                                name + ".out"},
                               name + ".log", kLimit);
  if (!ran.ok()) return ran;
  Throughput result;
  if (std::sscanf(Slurp(name + ".out").c_str(), "tokens_per_s %lf ms_per_step %lf steps %d",
                  &result.tokens_per_s, &result.ms_per_step, &result.steps) != 3) {
    return absl::InternalError(absl::StrCat(name,
                                            ".out: expected \"tokens_per_s X "
                                            "ms_per_step Y steps N\", got: ",
                                            Slurp(name + ".out")));
  }
  return result;
}

}  // namespace muster::tools
