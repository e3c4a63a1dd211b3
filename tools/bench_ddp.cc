// bench_ddp: what data parallelism costs and gains on this machine's CPU.
//   1. allreduce bus bandwidth over loopback, 1 KB .. 64 MB, 2 and 3 ranks
//      (threads): our Gloo ProcessGroup against gloo's ring allreduce
//      called directly;
//   2. scaling: global tokens/s of the `worker` with N ranks under
//      `launch --standalone` against 1 rank, on a small GPT;
//   3. overlap: the fraction of the gradient allreduce hidden behind the
//      backward pass (tools/bench_ddp_overlap.h says how it is measured);
//   4. PyTorch DDP (gloo) on the same model and micro-batch under the same
//      launcher when /usr/bin/python3 has torch, and ours/theirs.
// Every rank computes with one thread (launch's OMP_NUM_THREADS=1).
//
//   bazel run //tools:bench_ddp -- [--steps 10] [--nproc 2] [--bucket-mb 25]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "tools/bench_ddp_allreduce.h"
#include "tools/bench_ddp_overlap.h"
#include "tools/bench_ddp_runs.h"

namespace muster::tools {
namespace {

// The in-process ranks (sections 1 and 3) must compute with one thread
// each, like launched workers; OpenMP and OpenBLAS read these variables
// when they load, before main(), hence one re-exec with them set.
void OneThreadPerRank(char** argv) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("OMP_WAIT_POLICY", "passive", 0);
  execv("/proc/self/exe", argv);
}

// A file of this build: next to the binary's runfiles, or under bazel-bin.
std::string BuiltFile(const std::string& workspace_relative) {
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  for (const std::filesystem::path& candidate :
       {std::filesystem::path(self.string() + ".runfiles/muster") / workspace_relative,
        self.parent_path().parent_path() / workspace_relative}) {
    if (access(candidate.c_str(), R_OK) == 0) return candidate.string();
  }
  return "";
}

worker::TrainConfig SmallGpt(int micro_batch, double bucket_mb) {
  worker::TrainConfig config;
  config.model.layers = 4;
  config.model.dim = 256;
  config.model.heads = 4;
  config.model.vocab = 256;
  config.model.seq_len = 128;
  config.data.micro_batch = micro_batch;
  config.device = "cpu";
  config.parallel.bucket_mb = bucket_mb;
  return config;
}

void PrintAllreduce(int ranks, double max_mb) {
  std::vector<size_t> sizes;
  for (size_t bytes = 1024; bytes <= max_mb * (1 << 20); bytes *= 4) sizes.push_back(bytes);
  auto rows = MeasureAllreduce(ranks, sizes);
  if (!rows.ok()) {
    std::printf("allreduce, %d ranks: failed: %s\n", ranks, rows.status().ToString().c_str());
    return;
  }
  std::printf("\nallreduce (sum, float32) over loopback, %d ranks as threads; "
              "busbw = 2(n-1)/n * bytes / time\n", ranks);
  std::printf("%10s %6s %12s %12s %12s %12s %8s\n", "bytes", "iters", "ours us", "gloo us",
              "ours GB/s", "gloo GB/s", "ours/gloo");
  for (const AllreduceFigures& row : *rows) {
    std::printf("%10zu %6d %12.1f %12.1f %12.3f %12.3f %8.2f\n", row.bytes, row.iterations,
                row.ours_us, row.gloo_us, row.ours_busbw_gbs, row.gloo_busbw_gbs,
                row.ours_busbw_gbs / row.gloo_busbw_gbs);
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  int steps = 10, warmup = 2, nproc = 2, micro_batch = 8;
  double bucket_mb = 25.0, max_mb = 64.0;
  std::vector<int> allreduce_ranks = {2, 3};
  // The config's buckets, and buckets of about one stage each (this
  // model's blocks are 3 MB), where backward can hide the reduction.
  std::vector<double> overlap_bucket_mb = {25.0, 2.0};
  bool skip_allreduce = false, skip_torch = false;
  CLI::App app("bench_ddp: allreduce bandwidth, DDP scaling and overlap, against PyTorch DDP");
  app.add_option("--steps", steps, "Timed training steps per job")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--nproc", nproc, "Ranks of the DDP jobs")->capture_default_str();
  app.add_option("--micro-batch", micro_batch, "B per rank")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "parallel.bucket_mb (and PyTorch's bucket_cap_mb)")
      ->capture_default_str();
  app.add_option("--allreduce-ranks", allreduce_ranks, "Rank counts of the allreduce table");
  app.add_option("--overlap-bucket-mb", overlap_bucket_mb, "bucket_mb values of the overlap "
                 "table");
  app.add_option("--max-mb", max_mb, "Largest allreduce, MB")->capture_default_str();
  app.add_flag("--skip-allreduce", skip_allreduce, "No allreduce table");
  app.add_flag("--skip-torch", skip_torch, "No PyTorch comparison");
  CLI11_PARSE(app, argc, argv);

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
  const worker::TrainConfig config = SmallGpt(micro_batch, bucket_mb);
  if (absl::Status data = WriteBenchData(paths.dir, config.model.vocab); !data.ok()) {
    std::fprintf(stderr, "bench_ddp: %s\n", data.ToString().c_str());
    return 1;
  }
  const worker::ModelConfig& m = config.model;
  std::printf("\nDDP on GPT L=%d C=%d NH=%d T=%d V=%d, B=%d per rank, bucket_mb %g, "
              "%d timed steps after %d; one thread per rank\n",
              m.layers, m.dim, m.heads, m.seq_len, m.vocab, micro_batch, bucket_mb, steps,
              warmup);
  int status = 0;
  auto one = RunWorkerJob(paths, config, 1, warmup, steps);
  auto many = RunWorkerJob(paths, config, nproc, warmup, steps);
  auto report = [&](const char* name, const absl::StatusOr<Throughput>& run) {
    if (run.ok()) {
      std::printf("  %-34s %10.0f tok/s %9.1f ms/step\n", name, run->tokens_per_s,
                  run->ms_per_step);
    } else {
      std::printf("  %-34s failed: %s\n", name, run.status().ToString().c_str());
      status = 1;
    }
    std::fflush(stdout);
  };
  report("muster worker, 1 rank", one);
  report(absl::StrCat("muster worker, ", nproc, " ranks (launch)").c_str(), many);
  if (one.ok() && many.ok()) {
    std::printf("  scaling efficiency: %.2f (tok/s at %d ranks / (%d x tok/s at 1))\n",
                many->tokens_per_s / (nproc * one->tokens_per_s), nproc, nproc);
  }

  worker::TrainConfig in_process = config;
  in_process.data.train = paths.dir + "/train_*.bin";
  std::printf("\noverlap (%d ranks as threads, Trainer + DdpDataParallel; medians over "
              "steps):\n", nproc);
  std::printf("%10s %8s %12s %10s %10s %12s %10s %8s\n", "bucket_mb", "buckets", "gradient MB",
              "step ms", "skew ms", "exposed ms", "bare ms", "hidden");
  for (double overlap_mb : overlap_bucket_mb) {
    in_process.parallel.bucket_mb = overlap_mb;
    auto overlap = MeasureOverlap(in_process, nproc, warmup, steps);
    if (!overlap.ok()) {
      std::printf("%10g failed: %s\n", overlap_mb, overlap.status().ToString().c_str());
      status = 1;
      continue;
    }
    std::printf("%10g %8d %12.2f %10.1f %10.2f %12.2f %10.2f %7.0f%%\n", overlap_mb,
                overlap->buckets, overlap->gradient_floats * 4 / 1048576.0, overlap->step_ms,
                overlap->skew_ms, overlap->exposed_ms, overlap->bare_ms, 100 * overlap->hidden);
    std::fflush(stdout);
  }
  std::printf("  skew: between the ranks' ends of backward; exposed: the wait for the "
              "reduction after backward\n"
              "  (GradientReducer::last_exposed_wait) of the rank that ended backward last;\n"
              "  bare: the same buckets reduced with nothing else running; "
              "hidden = 1 - exposed / bare\n");

  if (!skip_torch) {
    const std::string script = BuiltFile("tools/bench_ddp_torch.py");
    auto torch_one = RunTorchDdpJob(paths, script, config, 1, warmup, steps);
    if (absl::IsNotFound(torch_one.status())) {
      std::printf("\nPyTorch: %s; not compared\n", torch_one.status().ToString().c_str());
    } else {
      auto torch_many = RunTorchDdpJob(paths, script, config, nproc, warmup, steps);
      std::printf("\n");
      report("PyTorch DDP (gloo), 1 rank", torch_one);
      report(absl::StrCat("PyTorch DDP (gloo), ", nproc, " ranks").c_str(), torch_many);
      if (torch_one.ok() && torch_many.ok()) {
        std::printf("  PyTorch scaling efficiency: %.2f\n",
                    torch_many->tokens_per_s / (nproc * torch_one->tokens_per_s));
      }
      if (torch_many.ok() && many.ok()) {
        std::printf("  muster / PyTorch tokens/s at %d ranks: %.2f (goal >= 1.5)\n", nproc,
                    many->tokens_per_s / torch_many->tokens_per_s);
      }
    }
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
