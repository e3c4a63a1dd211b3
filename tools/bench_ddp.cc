// bench_ddp: what data parallelism costs and gains on this machine's CPU,
// or on its GPU (--device cuda).
//   1. allreduce bus bandwidth over loopback, 1 KB .. 64 MB, 2 and 3 ranks
//      (threads): our Gloo ProcessGroup against gloo's ring allreduce
//      called directly;
//   2. throughput of a small GPT: our `worker` and PyTorch DDP (gloo, when
//      /usr/bin/python3 has torch) at 1 rank and at N ranks under
//      `launch --standalone`: global tokens/s, scaling efficiency, and
//      ours/theirs;
//   3. overlap: the fraction of the gradient allreduce hidden behind the
//      backward pass (tools/ddp/overlap.h says how it is measured);
//   4. with --world-of-one BACKEND...: DDP with a world of one against no
//      DDP, in this process: the step time DDP adds, the buckets reduced
//      alone, and the part of them the step hid (MeasureWorldOfOne).
// Every rank computes with one thread (launch's OMP_NUM_THREADS=1).
//
// --device cuda (a build with --config=cuda, on a GPU node) trains GPT-2
// 124M (--small: the small GPT) in --precision (bf16 by default there)
// and runs 2 and 4 only: table 2 as 1 rank without DDP against
// `launch --nproc_per_node=N` ranks sharing GPU 0 over parallel.backend
// gloo (staged through pinned memory: NCCL refuses two ranks on one GPU),
// and table 4 over nccl and staged gloo. Tables 1 and 3 and PyTorch are
// CPU measurements.
//
//   bazel run //tools:bench_ddp -- [--steps 10] [--rounds 3] [--nproc 2]
//                                   [--bucket-mb 25] [--skip-allreduce]
//   bench_ddp --device cuda [--micro-batch 8] [--seq 1024]   (GPU node)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/matmul.h"
#include "tools/bench_util.h"
#include "tools/ddp/allreduce.h"
#include "tools/ddp/overlap.h"
#include "tools/ddp/runs.h"
#include "worker/strategy/strategy.h"

namespace muster::tools {
namespace {

void PrintAllreduce(int ranks, double max_mb) {
  std::vector<size_t> sizes;
  for (size_t bytes = 1024; bytes <= max_mb * (1 << 20); bytes *= 4) sizes.push_back(bytes);
  auto rows = MeasureAllreduce(ranks, sizes);
  if (!rows.ok()) {
    std::printf("allreduce, %d ranks: failed: %s\n", ranks, rows.status().ToString().c_str());
    return;
  }
  std::printf(
      "\nallreduce (sum, float32) over loopback, %d ranks as threads; "
      "busbw = 2(n-1)/n * bytes / time\n",
      ranks);
  std::printf("%10s %6s %12s %12s %12s %12s %8s\n", "bytes", "iters", "ours us", "gloo us",
              "ours GB/s", "gloo GB/s", "ours/gloo");
  for (const AllreduceFigures& row : *rows) {
    std::printf("%10zu %6d %12.1f %12.1f %12.3f %12.3f %8.2f\n", row.bytes, row.iterations,
                row.ours_us, row.gloo_us, row.ours_busbw_gbs, row.gloo_busbw_gbs,
                row.ours_busbw_gbs / row.gloo_busbw_gbs);
  }
  std::fflush(stdout);
}

// One measured configuration of the throughput table.
struct Job {
  std::string name;
  std::function<absl::StatusOr<Throughput>()> run;
  std::vector<Throughput> results;  // one per round
  absl::Status error;               // the first failure
};

// The round with the median tokens/s of `job` (its results are non-empty).
Throughput MedianRound(const Job& job) {
  std::vector<Throughput> sorted = job.results;
  std::sort(sorted.begin(), sorted.end(), [](const Throughput& a, const Throughput& b) {
    return a.tokens_per_s < b.tokens_per_s;
  });
  return sorted[sorted.size() / 2];
}

// Our worker and PyTorch DDP at 1 and `nproc` ranks. The jobs run in
// rounds, each round all of them in turn, so load from elsewhere on the
// machine lands on every job alike; each figure is the median round.
// The 1-rank job trains without DDP; the `nproc`-rank ones reduce over
// `backend` (parallel.backend).
int PrintThroughput(const JobPaths& paths, const worker::TrainConfig& config, int nproc, int warmup,
                    int steps, int rounds, bool skip_torch, const std::string& backend) {
  std::vector<Job> jobs;
  for (int ranks : {1, nproc}) {
    worker::TrainConfig job = config;
    if (ranks > 1) job.parallel.backend = backend;
    jobs.push_back({absl::StrCat("muster worker, ", ranks, ranks == 1 ? " rank" : " ranks"),
                    [=] { return RunWorkerJob(paths, job, ranks, warmup, steps); }});
  }
  const std::string script = BuiltFile("tools/bench_ddp_torch.py");
  for (int ranks : {1, nproc}) {
    if (skip_torch) break;
    jobs.push_back({absl::StrCat("PyTorch DDP (gloo), ", ranks, ranks == 1 ? " rank" : " ranks"),
                    [=] { return RunTorchDdpJob(paths, script, config, ranks, warmup, steps); }});
  }
  for (int round = 0; round < rounds; ++round) {
    for (Job& job : jobs) {
      auto result = job.run();
      if (result.ok()) {
        job.results.push_back(*result);
      } else if (job.error.ok()) {
        job.error = result.status();
      }
    }
  }
  int status = 0;
  std::vector<double> tokens_per_s;  // per job; 0: failed
  for (const Job& job : jobs) {
    if (job.results.empty()) {
      // No torch is not a failure of this benchmark.
      const bool absent = absl::IsNotFound(job.error);
      if (!absent) status = 1;
      std::printf("  %-30s %s: %s\n", job.name.c_str(), absent ? "not measured" : "failed",
                  job.error.ToString().c_str());
      tokens_per_s.push_back(0);
      continue;
    }
    const Throughput median = MedianRound(job);
    std::printf("  %-30s %9.0f tok/s %9.1f ms/step  (median of %zu rounds)\n", job.name.c_str(),
                median.tokens_per_s, median.ms_per_step, job.results.size());
    tokens_per_s.push_back(median.tokens_per_s);
  }
  for (size_t one = 0; one + 1 < jobs.size(); one += 2) {
    if (tokens_per_s[one] > 0 && tokens_per_s[one + 1] > 0) {
      std::printf("  %s: scaling efficiency %.2f (tok/s at %d ranks / (%d x tok/s at 1))\n",
                  one == 0 ? "muster" : "PyTorch",
                  tokens_per_s[one + 1] / (nproc * tokens_per_s[one]), nproc, nproc);
    }
  }
  if (jobs.size() == 4 && tokens_per_s[1] > 0 && tokens_per_s[3] > 0) {
    std::printf("  muster / PyTorch tokens/s at %d ranks: %.2f (goal >= 1.5)\n", nproc,
                tokens_per_s[1] / tokens_per_s[3]);
  }
  std::fflush(stdout);
  return status;
}

int PrintOverlap(worker::TrainConfig config, const std::vector<double>& bucket_mbs, int nproc,
                 int warmup, int steps) {
  std::printf(
      "\noverlap (%d ranks as threads, Trainer + Ddp; medians over "
      "steps):\n",
      nproc);
  std::printf("%10s %8s %12s %10s %10s %12s %10s %8s\n", "bucket_mb", "buckets", "gradient MB",
              "step ms", "skew ms", "exposed ms", "bare ms", "hidden");
  int status = 0;
  for (double bucket_mb : bucket_mbs) {
    config.parallel.bucket_mb = bucket_mb;
    auto overlap = MeasureOverlap(config, nproc, warmup, steps);
    if (!overlap.ok()) {
      std::printf("%10g failed: %s\n", bucket_mb, overlap.status().ToString().c_str());
      status = 1;
      continue;
    }
    std::printf("%10g %8d %12.2f %10.1f %10.2f %12.2f %10.2f %7.0f%%\n", bucket_mb,
                overlap->buckets, overlap->gradient_floats * 4 / 1048576.0, overlap->step_ms,
                overlap->skew_ms, overlap->exposed_ms, overlap->bare_ms, 100 * overlap->hidden);
    std::fflush(stdout);
  }
  std::printf(
      "  skew: between the ranks' ends of backward; exposed: the wait for the "
      "reduction after backward\n"
      "  (GradientReducer::last_exposed_wait) of the rank that ended backward last;\n"
      "  bare: the same buckets reduced with nothing else running; "
      "hidden = 1 - exposed / bare\n");
  return status;
}

int PrintWorldOfOne(const worker::TrainConfig& config, const std::vector<std::string>& backends,
                    int warmup, int steps, int rounds) {
  std::printf(
      "\nDDP with a world of one against no DDP, in this process on %s (Trainer; %d rounds of %d "
      "steps each, in turn, after %d; medians):\n",
      config.device.c_str(), rounds, steps, warmup);
  std::printf("  %-14s %8s %12s %10s %10s %12s %10s %8s\n", "data backend", "buckets",
              "gradient MB", "plain ms", "DDP ms", "overhead ms", "bare ms", "hidden");
  int status = 0;
  for (const std::string& name : backends) {
    parallel::DataBackend backend;
    if (name == "gloo") {
      backend = config.device == "cuda" ? parallel::DataBackend::kStagedGloo
                                        : parallel::DataBackend::kGloo;
    } else if (name == "nccl") {
      backend = parallel::DataBackend::kNccl;
    } else {
      std::printf("  %-14s unknown: expected gloo or nccl\n", name.c_str());
      status = 1;
      continue;
    }
    auto figures = MeasureWorldOfOne(config, backend, warmup, steps, rounds);
    if (!figures.ok()) {
      std::printf("  %-14s failed: %s\n", name.c_str(), figures.status().ToString().c_str());
      status = 1;
      continue;
    }
    // Below a millisecond of reduction, the difference of two step times
    // is noise, and so is its ratio to it.
    const std::string hidden =
        figures->bare_ms >= 1.0 ? absl::StrFormat("%.0f%%", 100 * figures->hidden) : "-";
    std::printf("  %-14s %8d %12.2f %10.2f %10.2f %12.2f %10.2f %8s\n",
                worker::DataBackendName(backend), figures->buckets,
                figures->gradient_floats * 4 / 1048576.0, figures->single_ms, figures->ddp_ms,
                figures->overhead_ms, figures->bare_ms, hidden.c_str());
    std::fflush(stdout);
  }
  std::printf(
      "  plain: no DDP; overhead = DDP ms - plain ms; bare: the same buckets reduced with "
      "nothing else queued;\n  hidden = 1 - overhead / bare (below 0: DDP cost the step more "
      "than its reductions take alone;\n  -: bare under 1 ms, too little to tell from noise)\n");
  return status;
}

int Main(int argc, char** argv) {
  int steps = 10, warmup = 2, nproc = 2, micro_batch = 8, rounds = 3;
  double bucket_mb = 25.0, max_mb = 64.0;
  std::vector<int> allreduce_ranks = {2, 3};
  // The config's buckets, and buckets of about one stage each (this
  // model's blocks are 3 MB), where backward can hide the reduction.
  std::vector<double> overlap_bucket_mb = {25.0, 2.0};
  bool skip_allreduce = false, skip_torch = false, skip_throughput = false, skip_overlap = false;
  std::string device = "cpu", precision = "auto", backend;
  bool small = false;
  int seq_len = 0;
  std::vector<std::string> world_of_one;
  CLI::App app("bench_ddp: allreduce bandwidth, DDP scaling and overlap, against PyTorch DDP");
  app.add_option("--steps", steps, "Timed training steps per job")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--nproc", nproc, "Ranks of the DDP jobs")->capture_default_str();
  app.add_option("--rounds", rounds, "Rounds of the throughput jobs (median)")
      ->capture_default_str();
  app.add_option("--micro-batch", micro_batch, "B per rank")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "parallel.bucket_mb (and PyTorch's bucket_cap_mb)")
      ->capture_default_str();
  app.add_option("--allreduce-ranks", allreduce_ranks, "Rank counts of the allreduce table");
  app.add_option("--overlap-bucket-mb", overlap_bucket_mb,
                 "bucket_mb values of the overlap "
                 "table");
  app.add_option("--max-mb", max_mb, "Largest allreduce, MB")->capture_default_str();
  app.add_flag("--skip-allreduce", skip_allreduce, "No allreduce table");
  app.add_flag("--skip-torch", skip_torch, "No PyTorch comparison");
  app.add_flag("--skip-throughput", skip_throughput, "No throughput table");
  app.add_flag("--skip-overlap", skip_overlap, "No overlap table (ranks as threads)");
  app.add_option("--device", device, "cpu, or cuda: GPT-2 124M on GPU 0 (tables 2 and 4)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_flag("--small", small, "With --device cuda: the small GPT, not GPT-2 124M");
  app.add_option("--seq", seq_len, "T (default: 128 for the small GPT, 1024 for GPT-2 124M)");
  app.add_option("--precision", precision, "precision: auto, fp32, tf32 or bf16 (CUDA)")
      ->capture_default_str();
  app.add_option("--backend", backend,
                 "parallel.backend of the N-rank throughput jobs (default: auto; gloo on cuda)");
  app.add_option("--world-of-one", world_of_one,
                 "Backends of the world-of-one table: gloo, nccl (default: none on cpu; nccl "
                 "gloo on cuda)");
  CLI11_PARSE(app, argc, argv);
  const bool cuda = device == "cuda";
  if (cuda) {
    // Tables 1 and 3 and the PyTorch jobs measure the CPU.
    skip_allreduce = skip_torch = skip_overlap = true;
    if (backend.empty()) backend = "gloo";
    if (world_of_one.empty()) world_of_one = {"nccl", "gloo"};
  }
  if (backend.empty()) backend = "auto";

  if (!skip_allreduce) {
    for (int ranks : allreduce_ranks) PrintAllreduce(ranks, max_mb);
  }

  JobPaths paths{BuiltFile("launcher/launch"), BuiltFile("worker/worker"), ""};
  if (paths.launch.empty() || paths.worker.empty()) {
    std::fprintf(stderr, "bench_ddp: launcher/launch or worker/worker not built next to me\n");
    return 2;
  }
  char dir_template[] = "/tmp/bench_ddp_XXXXXX";
  paths.dir = mkdtemp(dir_template);
  worker::TrainConfig config = SmallGpt(micro_batch, bucket_mb);
  if (cuda && !small) {
    config = Gpt2Small(1024, micro_batch);
    config.parallel.bucket_mb = bucket_mb;
  }
  if (seq_len > 0) config.model.seq_len = seq_len;
  config.device = device;
  config.precision = precision;
  if (absl::Status data = WriteBenchData(paths.dir, config.model.vocab); !data.ok()) {
    std::fprintf(stderr, "bench_ddp: %s\n", data.ToString().c_str());
    return 1;
  }
  const worker::ModelConfig& m = config.model;
  std::printf(
      "\nDDP on GPT L=%d C=%d NH=%d T=%d V=%d, B=%d per rank, bucket_mb %g, %s, precision %s, "
      "%d timed steps after %d; one thread per rank\n",
      m.layers, m.dim, m.heads, m.seq_len, m.vocab, micro_batch, bucket_mb, device.c_str(),
      precision.c_str(), steps, warmup);
  // The workers and PyTorch inherit this environment, so the same kernels
  // (PyTorch 1.13 takes its GEMMs from the same OpenBLAS).
  std::printf("CPU GEMMs: %s\n", kernels::CpuGemmDescription().c_str());
  int status = 0;
  if (!skip_throughput) {
    std::printf("throughput (%d ranks: parallel.backend %s)\n", nproc, backend.c_str());
    status |= PrintThroughput(paths, config, nproc, warmup, steps, rounds, skip_torch, backend);
  }
  worker::TrainConfig in_process = config;
  in_process.data.train = paths.dir + "/train_*.bin";
  if (!skip_overlap) status |= PrintOverlap(in_process, overlap_bucket_mb, nproc, warmup, steps);
  if (!world_of_one.empty()) {
    status |= PrintWorldOfOne(in_process, world_of_one, warmup, steps, rounds);
  }
  std::filesystem::remove_all(paths.dir);
  return status;
}

}  // namespace
}  // namespace muster::tools

int main(int argc, char** argv) {
  muster::tools::OneThreadPerRank(argv);
  return muster::tools::Main(argc, argv);
}
