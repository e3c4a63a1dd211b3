// Training throughput of the CPU worker: tokens/s, ms/step and MFU for
//   (a) L=4, C=256, NH=4, T=128, B=8, V=256 (the small model), and
//   (b) GPT-2 124M (L=12, C=768, NH=12, V=50257) at T=64, B=4,
// one full optimizer step each (forward, backward, clip, AdamW, zero),
// random tokens, timed after warm-up steps. If /usr/bin/python3 has torch,
// model (a) is also trained in PyTorch on the CPU for the same steps and
// the ratio printed.
//
//   bazel run -c opt //tools:bench_train -- [--steps 10] [--big-steps 3]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/model/model.h"
#include "worker/optim/optim.h"
#include "worker/trainer/metrics.h"

namespace muster::worker {
namespace {

struct BenchResult {
  double ms_per_step = 0;
  double tokens_per_s = 0;
  double mfu = 0;
  size_t parameters = 0;
};

absl::StatusOr<BenchResult> Bench(const ModelConfig& config, int B, int T, int warmup, int steps,
                                  double peak) {
  auto created = GptModel::Create(config, B, Device::kCpu);
  if (!created.ok()) return created.status();
  std::unique_ptr<GptModel> model = *std::move(created);
  model->InitWeights(1337);
  OptimConfig optim;
  auto made = AdamW::Create(model.get(), optim);
  if (!made.ok()) return made.status();
  AdamW& adamw = **made;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> token(0, config.vocab - 1);
  std::vector<int> inputs(B * T), targets(B * T);  // (B, T)
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = token(rng);
    targets[i] = token(rng);
  }
  auto step = [&](int s) {
    model->Forward(inputs.data(), targets.data(), B, T);
    model->Backward(1.0f);
    ClipGradNorm(model.get(), 1.0f);
    adamw.Step(3e-4f, s + 1);
    model->ZeroGrad();
  };
  for (int s = 0; s < warmup; ++s) step(s);
  auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) step(warmup + s);
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  BenchResult result;
  result.ms_per_step = seconds * 1e3;
  result.tokens_per_s = B * T / seconds;
  result.parameters = model->num_parameters();
  result.mfu = peak > 0 ? FlopsPerToken(config, T) * result.tokens_per_s / peak : 0;
  return result;
}

void Print(const std::string& name, int B, int T, const BenchResult& r) {
  std::printf("%-34s %7.2fM params  B=%d T=%-4d %9.1f ms/step %9.0f tok/s  MFU %5.1f%%\n",
              name.c_str(), r.parameters / 1e6, B, T, r.ms_per_step, r.tokens_per_s, 100 * r.mfu);
  std::fflush(stdout);
}

// tools/bench_train_torch.py in this binary's runfiles.
std::string TorchScript() {
  std::vector<std::string> candidates;
  if (const char* dir = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(absl::StrCat(dir, "/muster/tools/bench_train_torch.py"));
  }
  std::error_code error;
  auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    candidates.push_back(self.string() + ".runfiles/muster/tools/bench_train_torch.py");
  }
  candidates.push_back("tools/bench_train_torch.py");
  for (const std::string& path : candidates) {
    if (access(path.c_str(), R_OK) == 0) return path;
  }
  return "";
}

// Runs the PyTorch twin of model (a) with `env` (VAR=value ..., may be
// empty) before the command; returns its ms/step, or 0 if torch or the
// script is unavailable.
double TorchMsPerStep(int B, int T, int warmup, int steps, int threads, const std::string& env) {
  const char* python = "/usr/bin/python3";
  if (access(python, X_OK) != 0 ||
      std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    std::printf("PyTorch: /usr/bin/python3 has no torch; skipping the comparison\n");
    return 0;
  }
  std::string script = TorchScript();
  if (script.empty()) {
    std::printf("PyTorch: tools/bench_train_torch.py not found in runfiles; skipping\n");
    return 0;
  }
  std::string command = absl::StrFormat(
      "%s%s %s --layers 4 --dim 256 --heads 4 --vocab 256 --seq %d --batch %d --steps %d "
      "--warmup %d --threads %d 2>&1",
      env.empty() ? "" : "env " + env + " ", python, script, T, B, steps, warmup, threads);
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return 0;
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  pclose(pipe);
  double ms = 0, tokens = 0;
  size_t at = output.find("torch ms_per_step");
  if (at == std::string::npos ||
      std::sscanf(output.c_str() + at, "torch ms_per_step %lf tokens_per_s %lf", &ms, &tokens) !=
          2) {
    std::printf("PyTorch run failed:\n%s", output.c_str());
    return 0;
  }
  return ms;
}

int Main(int argc, char** argv) {
  int steps = 10, big_steps = 3, warmup = 2;
  bool skip_big = false, skip_torch = false;
  CLI::App app("bench_train: training throughput of the CPU worker (and PyTorch's)");
  app.add_option("--steps", steps, "Timed steps of model (a)")->capture_default_str();
  app.add_option("--big-steps", big_steps, "Timed steps of GPT-2 124M")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_flag("--skip-124m", skip_big, "Only model (a)");
  app.add_flag("--skip-torch", skip_torch, "No PyTorch comparison");
  CLI11_PARSE(app, argc, argv);

  std::string peak_description;
  double peak = PeakFlops(Device::kCpu, Precision::kFp32, &peak_description);
  std::printf("bench_train: peak for MFU: %s\n", peak_description.c_str());

  ModelConfig small;  // (a)
  small.layers = 4;
  small.dim = 256;
  small.heads = 4;
  small.vocab = 256;
  small.seq_len = 128;
  auto a = Bench(small, 8, 128, warmup, steps, peak);
  if (!a.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", a.status().ToString().c_str());
    return 1;
  }
  Print("(a) L=4 C=256 NH=4 V=256", 8, 128, *a);

  if (!skip_big) {
    // wpe holds seq_len rows: 64 here instead of GPT-2's 1024, so the
    // parameter count is 123.6M rather than 124.4M; the FLOPs per token
    // are the same.
    ModelConfig gpt2;
    gpt2.layers = 12;
    gpt2.dim = 768;
    gpt2.heads = 12;
    gpt2.vocab = 50257;
    gpt2.seq_len = 64;
    auto b = Bench(gpt2, 4, 64, 1, big_steps, peak);
    if (!b.ok()) {
      std::fprintf(stderr, "bench_train: %s\n", b.status().ToString().c_str());
      return 1;
    }
    Print("(b) GPT-2 124M", 4, 64, *b);
  }

  if (!skip_torch) {
    int threads = 0;
    if (const char* omp = std::getenv("OMP_NUM_THREADS")) threads = std::atoi(omp);
    if (threads <= 0) threads = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
    double torch_ms = TorchMsPerStep(8, 128, warmup, steps, threads, "");
    if (torch_ms > 0 && threads > 1) {
      // Debian's PyTorch takes its GEMMs from the pthreads build of
      // OpenBLAS, whose thread pool spins against OpenMP's (ours did too,
      // kernels/cpu_gemm.h): with 2 threads on 2 cores its step took
      // 1.4-1.9x as long as with OpenBLAS held to one thread
      // (2026-11-26). A user would run it the faster way, so the peer is
      // measured both ways and the faster one is compared.
      const double one_blas_thread =
          TorchMsPerStep(8, 128, warmup, steps, threads, "OPENBLAS_NUM_THREADS=1");
      std::printf(
          "(a) in PyTorch on the CPU (%d threads): %.1f ms/step; with OPENBLAS_NUM_THREADS=1: "
          "%.1f ms/step\n",
          threads, torch_ms, one_blas_thread);
      if (one_blas_thread > 0) torch_ms = std::min(torch_ms, one_blas_thread);
    }
    if (torch_ms > 0) {
      std::printf(
          "(a) in PyTorch on the CPU (%d threads, the faster way): %.1f ms/step; "
          "PyTorch time / muster time = %.2f (above 1: muster is faster)\n",
          threads, torch_ms, torch_ms / a->ms_per_step);
    }
  }
  return 0;
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) { return muster::worker::Main(argc, argv); }
