// bench_fsdp: what sharding the training state (worker/strategy/fsdp/fsdp.h) costs and
// saves on this machine's CPU, against DDP.
//   1. throughput at N ranks as threads (tools/fsdp/threads.h) of
//      bench_ddp's small GPT: DDP, FSDP ZeRO-1, ZeRO-2 and ZeRO-3, and
//      ZeRO-3 gathering parameters in bf16 (half the bytes), in rounds, every job once per round,
//      so load from elsewhere on the machine lands on each alike; medians over rounds, and
//      FSDP/DDP;
//   2. in the same runs, the part of FSDP's all-gathers and
//      reduce-scatters that compute hides: exposed wait against the same
//      collectives alone;
//   3. the throughput jobs again as `worker` processes under `launch`
//      (what threads of one process cannot show: each rank's allocator
//      and communication threads), median step times and FSDP/DDP;
//   4. peak RSS per rank of GPT-2 124M, the real `worker` under the real
//      `launch`, DDP and ZeRO-3 at 2 and 4 ranks (tools/fsdp/rss.h),
//      next to the training state the formula gives (FsdpMemoryFormula).
// Every rank computes with one thread (launch's OMP_NUM_THREADS=1).
//
//   bazel build -c opt //tools:bench_fsdp && bazel-bin/tools/bench_fsdp
//       [--steps 6] [--rounds 9] [--nproc 2] [--skip-throughput]
//       [--skip-rss] [--rss-ranks 2 4] [--rss-steps 3] [--pin]
//       [--skip-processes] [--proc-rounds 3] [--proc-steps 12] [--proc-warmup 3]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/matmul.h"
#include "parallel/process_group.h"
#include "tools/bench_util.h"
#include "tools/fsdp/rss.h"
#include "tools/fsdp/threads.h"
#include "worker/data/data.h"
#include "worker/model/model.h"
#include "worker/strategy/fsdp/fsdp.h"

namespace muster::tools {
namespace {

// One configuration of the throughput table; zero 0 is DDP.
struct Job {
  std::string name;
  int zero = 0;
  worker::GatherDtype gather = worker::GatherDtype::kFp32;
  std::vector<ThreadsRun> runs;  // one per round
  absl::Status error;            // the first failure
};

template <typename Field>
double MedianOf(const Job& job, Field field) {
  std::vector<double> values;
  for (const ThreadsRun& run : job.runs) values.push_back(run.*field);
  return Median(values);
}

// alone_ms: each FSDP job's collectives alone (median, ms), by name, for
// the process table's overlap.
int PrintThroughput(const worker::TrainConfig& config, int nproc, int warmup, int steps, int rounds,
                    int replays, bool pin, std::map<std::string, double>* alone_ms) {
  const worker::ModelConfig& m = config.model;
  std::printf(
      "FSDP against DDP on GPT L=%d C=%d NH=%d T=%d V=%d, B=%d per rank, %d ranks as threads, "
      "DDP bucket_mb %g;\n%d timed steps after %d, %d rounds (each job once per round); one "
      "thread per rank%s\n",
      m.layers, m.dim, m.heads, m.seq_len, m.vocab, config.data.micro_batch, nproc,
      config.parallel.bucket_mb, steps, warmup, rounds,
      pin ? ", rank r's pinned to the r-th CPU" : "");
  std::printf("CPU GEMMs: %s\n", kernels::CpuGemmDescription().c_str());
  std::fflush(stdout);
  std::vector<Job> jobs = {{"DDP", 0},
                           {"FSDP ZeRO-1", 1},
                           {"FSDP ZeRO-2", 2},
                           {"FSDP ZeRO-3", 3},
                           {"ZeRO-3 bf16g", 3, worker::GatherDtype::kBf16}};
  for (int round = 0; round < rounds; ++round) {
    for (Job& job : jobs) {
      auto run = RunThreadsJob(config, job.zero, job.gather, nproc, warmup, steps, replays, pin);
      if (run.ok()) {
        job.runs.push_back(*run);
      } else if (job.error.ok()) {
        job.error = run.status();
      }
    }
    std::printf("  round %d/%d:", round + 1, rounds);
    for (const Job& job : jobs) {
      if (job.runs.size() == static_cast<size_t>(round) + 1) {
        std::printf("  %s %.0f", job.name.c_str(), job.runs.back().tokens_per_s);
      }
    }
    std::printf(" tok/s\n");
    std::fflush(stdout);
  }
  int status = 0;
  std::printf("\n  %-12s %10s %9s %9s %9s\n", "job", "tok/s", "ms/step", "/DDP", "/DDP");
  std::printf("  %-12s %10s %9s %9s %9s\n", "", "(median)", "(median)", "medians", "per round");
  for (const Job& job : jobs) {
    if (job.runs.empty()) {
      std::printf("  %-12s failed: %s\n", job.name.c_str(), job.error.ToString().c_str());
      status = 1;
      continue;
    }
    const double tokens = MedianOf(job, &ThreadsRun::tokens_per_s);
    std::printf("  %-12s %10.0f %9.1f", job.name.c_str(), tokens,
                MedianOf(job, &ThreadsRun::ms_per_step));
    if (job.zero != 0 && !jobs[0].runs.empty()) {
      // Per round: the two jobs ran back to back under the same load.
      std::vector<double> ratios;
      for (size_t r = 0; r < std::min(job.runs.size(), jobs[0].runs.size()); ++r) {
        ratios.push_back(job.runs[r].tokens_per_s / jobs[0].runs[r].tokens_per_s);
      }
      std::printf(" %9.3f %9.3f", tokens / MedianOf(jobs[0], &ThreadsRun::tokens_per_s),
                  Median(ratios));
    }
    std::printf("\n");
  }
  std::printf(
      "  goal: FSDP (ZeRO-3) >= 0.9x DDP tokens/s at 2 ranks. bf16g: parameters all-gathered in "
      "bf16\n");

  std::printf(
      "\n  communication hidden behind compute (per step, medians; exposed = "
      "Fsdp::waits() gather_s + reduce_s;\n  alone = the step's recorded all-gathers and "
      "reduce-scatters issued with nothing else running):\n");
  std::printf("  %-12s %8s %8s %9s %9s %10s %10s %10s %8s %8s\n", "job", "gathers", "reduces",
              "gather MB", "reduce MB", "alone ms", "exposed ms", "least ms", "hidden", "(least)");
  for (const Job& job : jobs) {
    if (job.zero == 0 || job.runs.empty()) continue;
    const ThreadsRun& first = job.runs[0];
    const double alone = MedianOf(job, &ThreadsRun::alone_ms);
    const double exposed = MedianOf(job, &ThreadsRun::exposed_ms);
    const double least = MedianOf(job, &ThreadsRun::exposed_least_ms);
    (*alone_ms)[job.name] = alone;
    std::printf("  %-12s %8d %8d %9.1f %9.1f %10.2f %10.2f %10.2f %7.0f%% %7.0f%%\n",
                job.name.c_str(), first.gathers, first.reduces, first.gathered_mb, first.reduced_mb,
                alone, exposed, least, 100 * (1 - exposed / alone), 100 * (1 - least / alone));
    if (first.replayed != first.gathers + first.reduces) {
      std::printf("  %s: replayed %d collectives, Fsdp counted %d\n", job.name.c_str(),
                  first.replayed, first.gathers + first.reduces);
      status = 1;
    }
  }
  std::printf(
      "\n  the exposed waits split (per step, medians, ms): each rank's own, and the mean over "
      "ranks of the\n  waits counted from when every rank had issued the collective; skew = "
      "the mean exposed less that: waiting for\n  a peer to arrive, which DDP's bucket waits "
      "(its row) pay too\n");
  std::printf("  %-12s %24s %12s %8s %10s\n", "job", "exposed per rank", "peers there", "skew",
              "hidden");
  for (const Job& job : jobs) {
    if (job.runs.empty()) continue;
    std::string per_rank;
    for (size_t r = 0; r < job.runs[0].exposed_rank_ms.size(); ++r) {
      std::vector<double> values;
      for (const ThreadsRun& run : job.runs) values.push_back(run.exposed_rank_ms[r]);
      absl::StrAppend(&per_rank, per_rank.empty() ? "" : " / ",
                      absl::StrFormat("%.2f", Median(values)));
    }
    const double arrived = MedianOf(job, &ThreadsRun::exposed_arrived_ms);
    if (arrived < 0) {
      std::printf("  %-12s %24s %12s\n", job.name.c_str(), per_rank.c_str(), "(no line-up)");
      continue;
    }
    const double skew = MedianOf(job, &ThreadsRun::exposed_ms) - arrived;
    if (job.zero == 0) {
      std::printf("  %-12s %24s %12.2f %8.2f %10s\n", job.name.c_str(), per_rank.c_str(), arrived,
                  skew, "-");
    } else {
      const double alone = MedianOf(job, &ThreadsRun::alone_ms);
      std::printf("  %-12s %24s %12.2f %8.2f %9.0f%%\n", job.name.c_str(), per_rank.c_str(),
                  arrived, skew, 100 * (1 - arrived / alone));
    }
  }
  std::printf(
      "  exposed: mean over ranks; least: the rank that waited least (the rest is skew);\n"
      "  hidden = 1 - exposed / alone. goal: >= 70%% hidden (ZeRO-3)\n");
  std::fflush(stdout);
  return status;
}

// The floats of every stage of `config`'s model, and the most one of
// `ranks` shard ranks owns (worker/strategy/fsdp/fsdp.h: EvenCounts per stage, rank 0
// gets the remainders).
absl::Status StateFloats(const worker::ModelConfig& config, int ranks, uint64_t* total,
                         uint64_t* owned_max) {
  auto model = worker::GptModel::Create(config, 1, worker::Device::kCpu, worker::Precision::kFp32,
                                        worker::ParamStorage::kExternal);
  if (!model.ok()) return model.status();
  *total = 0;
  *owned_max = 0;
  for (const worker::Stage& stage : (*model)->stages()) {
    *total += stage.size;
    *owned_max += parallel::EvenCounts(stage.size, ranks)[0];
  }
  return absl::OkStatus();
}

double Gb(uint64_t bytes) { return bytes / 1e9; }

int PrintRss(const RssPaths& paths, worker::TrainConfig config, const std::vector<int>& ranks,
             int steps) {
  const worker::ModelConfig& m = config.model;
  config.data.train = paths.dir + "/rss_train_*.bin";
  config.train.steps = steps;
  config.train.log_every = 1;
  config.train.eval_every = 0;
  if (absl::Status data = WriteRandomTokens(paths.dir + "/rss_train_000.bin", m.vocab);
      !data.ok()) {
    std::printf("rss: %s\n", data.ToString().c_str());
    return 1;
  }
  std::printf(
      "\npeak RSS per rank: GPT-2 L=%d C=%d NH=%d T=%d V=%d, B=%d, %d steps, `worker` processes "
      "under `launch --standalone`;\nstate = params + grads + AdamW m, v (formula: DDP 16 B x "
      "floats, ZeRO-3 16 B x the floats a rank owns)\n",
      m.layers, m.dim, m.heads, m.seq_len, m.vocab, config.data.micro_batch, steps);
  std::printf("  %5s %-7s %12s %12s %12s %12s %12s %7s\n", "ranks", "job", "RSS max GB",
              "RSS min GB", "state GB", "worker's GB", "RSS-state GB", "s");
  std::fflush(stdout);
  int status = 0;
  for (int nproc : ranks) {
    uint64_t total = 0, owned = 0;
    if (absl::Status sizes = StateFloats(m, nproc, &total, &owned); !sizes.ok()) {
      std::printf("  model: %s\n", sizes.ToString().c_str());
      return 1;
    }
    const worker::FsdpMemory z3 = worker::FsdpMemoryFormula(3, owned, total);
    const uint64_t state[2] = {16 * total, z3.params + z3.grads + z3.moments};
    uint64_t peak[2] = {0, 0};
    std::string line;
    for (int sharded = 0; sharded < 2; ++sharded) {
      config.parallel.strategy = sharded ? "fsdp" : "ddp";
      config.parallel.zero = 3;
      const std::string name = absl::StrCat(sharded ? "zero3_" : "ddp_", nproc);
      auto run = RunRssJob(paths, config, name, nproc);
      if (!run.ok()) {
        std::printf("  %5d %-7s failed: %s\n", nproc, sharded ? "ZeRO-3" : "DDP",
                    run.status().ToString().c_str());
        status = 1;
        continue;
      }
      peak[sharded] = *std::max_element(run->peak_rss_bytes.begin(), run->peak_rss_bytes.end());
      const uint64_t least =
          *std::min_element(run->peak_rss_bytes.begin(), run->peak_rss_bytes.end());
      const std::string counted =
          sharded
              ? absl::StrFormat(
                    "%.3f", Gb(*std::max_element(run->state_bytes.begin(), run->state_bytes.end())))
              : "-";
      std::printf("  %5d %-7s %12.3f %12.3f %12.3f %12s %12.3f %7.0f\n", nproc,
                  sharded ? "ZeRO-3" : "DDP", Gb(peak[sharded]), Gb(least), Gb(state[sharded]),
                  counted.c_str(), Gb(peak[sharded]) - Gb(state[sharded]), run->seconds);
      if (sharded) line = run->memory_lines[0];
      std::fflush(stdout);
    }
    if (!line.empty()) std::printf("        rank 0: %s\n", line.c_str());
    if (peak[0] > 0 && peak[1] > 0) {
      std::printf(
          "        ZeRO-3 / DDP at %d ranks: peak RSS %.3f, training state %.3f "
          "(goal at 4 ranks: state <= 0.35)\n",
          nproc, static_cast<double>(peak[1]) / peak[0], static_cast<double>(state[1]) / state[0]);
    }
    std::fflush(stdout);
  }
  return status;
}

// The median "ms" of the step records after step `warmup` in a worker's
// metrics file (JSONL, one {"step":N,"loss":...,"ms":...} per step).
// The median of `field` ("ms", "comm_wait_ms") over the steps after
// `warmup` of a metrics file.
absl::StatusOr<double> MedianStepField(const std::string& path, const std::string& field,
                                       int warmup) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": no metrics file"));
  const std::string key = absl::StrCat("\"", field, "\":");
  std::vector<double> values;
  std::string line;
  while (std::getline(in, line)) {
    int step = 0;
    const size_t at = line.find(key);
    if (std::sscanf(line.c_str(), "{\"step\":%d", &step) != 1 || at == std::string::npos) continue;
    double value = 0;
    if (step > warmup && std::sscanf(line.c_str() + at + key.size(), "%lf", &value) == 1) {
      values.push_back(value);
    }
  }
  if (values.empty()) {
    return absl::InternalError(
        absl::StrCat(path, ": no ", field, " in a timed step after step ", warmup));
  }
  return Median(values);
}

// The throughput jobs again as the product runs them: `worker` processes
// under `launch --standalone`, one per rank, in rounds (each job once per
// round), the median step time from each run's metrics file, the median
// over rounds, and each FSDP job against DDP (ratio of medians, and median
// of the rounds' ratios). The threads table above cannot see what is
// per-process: each rank's allocator, its own Gloo and work-queue threads.
// Then each job's wait on its collectives per step (the metrics'
// comm_wait_ms, the mean over ranks), and for FSDP the share of the
// collectives' time alone (`alone_ms`, from the threads table, where it
// ran) that the wait leaves hidden.
int PrintProcesses(const RssPaths& paths, worker::TrainConfig config, int nproc, int rounds,
                   int warmup, int steps, const std::map<std::string, double>& alone_ms) {
  config.data.train = paths.dir + "/proc_train_*.bin";
  config.train.steps = warmup + steps;
  config.train.log_every = 1;
  config.train.eval_every = 0;
  if (absl::Status data = WriteRandomTokens(paths.dir + "/proc_train_000.bin", config.model.vocab);
      !data.ok()) {
    std::printf("processes: %s\n", data.ToString().c_str());
    return 1;
  }
  struct ProcJob {
    const char* name;
    int zero;  // 0: DDP
    const char* gather;
    std::vector<double> ms;    // per round
    std::vector<double> wait;  // per round: comm_wait_ms
  };
  std::vector<ProcJob> jobs = {{"DDP", 0, "fp32", {}, {}},
                               {"FSDP ZeRO-2", 2, "fp32", {}, {}},
                               {"FSDP ZeRO-3", 3, "fp32", {}, {}},
                               {"ZeRO-3 bf16g", 3, "bf16", {}, {}}};
  const worker::ModelConfig& m = config.model;
  std::printf(
      "\nthe same as %d `worker` processes under `launch --standalone` (GPT L=%d C=%d T=%d, B=%d "
      "per rank): median step ms of steps %d..%d, %d rounds\n",
      nproc, m.layers, m.dim, m.seq_len, config.data.micro_batch, warmup + 1, warmup + steps,
      rounds);
  std::fflush(stdout);
  for (int round = 0; round < rounds; ++round) {
    std::printf("  round %d/%d:", round + 1, rounds);
    for (ProcJob& job : jobs) {
      config.parallel.strategy = job.zero == 0 ? "ddp" : "fsdp";
      config.parallel.zero = job.zero == 0 ? 3 : job.zero;
      config.parallel.gather_dtype = job.gather;
      const std::string name = absl::StrCat("proc_", job.zero, "_", job.gather, "_", round);
      config.train.metrics_file = absl::StrCat(paths.dir, "/", name, ".jsonl");
      std::remove(config.train.metrics_file.c_str());
      auto run = RunRssJob(paths, config, name, nproc);
      absl::StatusOr<double> ms = run.ok()
                                      ? MedianStepField(config.train.metrics_file, "ms", warmup)
                                      : absl::StatusOr<double>(run.status());
      absl::StatusOr<double> wait =
          ms.ok() ? MedianStepField(config.train.metrics_file, "comm_wait_ms", warmup) : ms;
      if (!wait.ok()) {
        std::printf("\n  %s failed: %s\n", job.name, wait.status().ToString().c_str());
        return 1;
      }
      job.ms.push_back(*ms);
      job.wait.push_back(*wait);
      std::printf("  %s %.1f ms", job.name, *ms);
      std::fflush(stdout);
    }
    std::printf("\n");
  }
  std::printf("  %-14s %10s %10s %10s %10s %10s %8s\n", "job", "ms/step", "/DDP", "/DDP",
              "comm wait", "alone", "hidden");
  std::printf("  %-14s %10s %10s %10s %10s %10s %8s\n", "", "(median)", "medians", "per round",
              "ms (mean)", "ms", "");
  const double ddp = Median(jobs[0].ms);
  for (const ProcJob& job : jobs) {
    std::vector<double> ratios;
    for (int r = 0; r < rounds; ++r) ratios.push_back(jobs[0].ms[r] / job.ms[r]);
    const double wait = Median(job.wait);
    std::printf("  %-14s %10.1f %10.3f %10.3f %10.2f", job.name, Median(job.ms),
                ddp / Median(job.ms), Median(ratios), wait);
    auto alone = alone_ms.find(job.name);
    if (job.zero != 0 && alone != alone_ms.end() && alone->second > 0) {
      std::printf(" %10.2f %7.0f%%", alone->second, 100 * (1 - wait / alone->second));
    }
    std::printf("\n");
  }
  std::printf(
      "  /DDP: DDP's step time over the job's (tokens/s against DDP's; above 1 is faster);\n"
      "  comm wait: each step's wait on the strategy's collectives, the mean over ranks (the\n"
      "  worker's comm_wait_ms), median over steps and rounds; alone: the same collectives\n"
      "  with nothing else running (threads table above); hidden = 1 - comm wait / alone\n");
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  int steps = 6, warmup = 2, nproc = 2, micro_batch = 8, rounds = 9, replays = 5;
  int rss_steps = 3, rss_micro_batch = 1, rss_seq_len = 64;
  double bucket_mb = 2.0;
  std::vector<int> rss_ranks = {2, 4};
  int proc_rounds = 3, proc_steps = 12, proc_warmup = 3;
  bool skip_throughput = false, skip_rss = false, skip_processes = false, pin = false;
  CLI::App app("bench_fsdp: FSDP (ZeRO-1/2/3) against DDP: throughput, overlap, memory");
  app.add_option("--steps", steps, "Timed training steps per job")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--rounds", rounds, "Rounds of the throughput jobs (median)")
      ->capture_default_str();
  app.add_option("--nproc", nproc, "Ranks of the throughput jobs")->capture_default_str();
  app.add_option("--micro-batch", micro_batch, "B per rank")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb,
                 "DDP's parallel.bucket_mb (2: about one block per bucket, its best here)")
      ->capture_default_str();
  app.add_option("--replays", replays, "Timed replays of the collectives alone, per job")
      ->capture_default_str();
  app.add_option("--rss-ranks", rss_ranks, "Rank counts of the peak RSS table")
      ->capture_default_str();
  app.add_option("--rss-steps", rss_steps, "Training steps of each RSS job")->capture_default_str();
  app.add_option("--rss-micro-batch", rss_micro_batch, "B per rank, RSS jobs")
      ->capture_default_str();
  app.add_option("--rss-seq-len", rss_seq_len, "T, RSS jobs")->capture_default_str();
  app.add_flag("--skip-throughput", skip_throughput, "No throughput and overlap tables");
  app.add_flag("--skip-rss", skip_rss, "No peak RSS table");
  app.add_flag("--skip-processes", skip_processes,
               "No throughput table of worker processes under launch");
  app.add_option("--proc-rounds", proc_rounds, "Rounds of the process jobs")->capture_default_str();
  app.add_option("--proc-steps", proc_steps, "Timed steps of each process job")
      ->capture_default_str();
  app.add_option("--proc-warmup", proc_warmup, "Untimed steps first, process jobs")
      ->capture_default_str();
  app.add_flag("--pin", pin,
               "Pin rank r's training thread to the r-th CPU (its communication threads float)");
  CLI11_PARSE(app, argc, argv);

  const std::string dir = MakeTempDir("bench_fsdp_");
  int status = 0;
  std::map<std::string, double> alone_ms;  // by job: the threads table's, for the process table
  if (!skip_throughput) {
    worker::TrainConfig config = SmallGpt(micro_batch, bucket_mb);
    config.data.train = dir + "/train_*.bin";
    if (absl::Status data = WriteRandomTokens(dir + "/train_000.bin", config.model.vocab);
        !data.ok()) {
      std::fprintf(stderr, "bench_fsdp: %s\n", data.ToString().c_str());
      return 1;
    }
    status |= PrintThroughput(config, nproc, warmup, steps, rounds, replays, pin, &alone_ms);
  }
  if (!skip_rss || !skip_processes) {
    RssPaths paths{BuiltFile("launcher/launch"), BuiltFile("worker/worker"),
                   std::filesystem::read_symlink("/proc/self/exe").string(), dir};
    if (paths.launch.empty() || paths.worker.empty()) {
      std::fprintf(stderr, "bench_fsdp: launcher/launch or worker/worker not built next to me\n");
      std::filesystem::remove_all(dir);
      return 2;
    }
    if (!skip_processes) {
      status |= PrintProcesses(paths, SmallGpt(micro_batch, bucket_mb), nproc, proc_rounds,
                               proc_warmup, proc_steps, alone_ms);
    }
    if (!skip_rss) {
      status |= PrintRss(paths, Gpt2Small(rss_seq_len, rss_micro_batch), rss_ranks, rss_steps);
    }
  }
  if (status == 0) {
    std::filesystem::remove_all(dir);
  } else {
    std::fprintf(stderr, "bench_fsdp: logs of the failed jobs kept in %s\n", dir.c_str());
  }
  return status;
}

}  // namespace
}  // namespace muster::tools

int main(int argc, char** argv) {
  // A rank of the RSS jobs (tools/fsdp/rss.h): no flags of ours.
  if (argc > 1 && std::strcmp(argv[1], muster::tools::kRssChildFlag) == 0) {
    return muster::tools::RssChildMain(argc, argv);
  }
  muster::tools::OneThreadPerRank(argv);
  return muster::tools::Main(argc, argv);
}
