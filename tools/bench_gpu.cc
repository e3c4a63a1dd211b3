// Training throughput of the CUDA worker on GPT-2 124M (L=12, C=768,
// NH=12, V=50257, seq_len=T): for each precision and each attention
// (--attention: auto, the worker's default and this tool's, which is
// cuDNN's in bf16 where it loads and muster's otherwise; muster's own
// kernels; gemm, muster's GEMM attention where flash attention would run;
// and/or cuDNN's, which runs in bf16 only), ms/step (median of the timed
// steps), tokens/s, MFU and peak GPU memory, one full optimizer step each
// (forward, backward, clip, AdamW, zero), random tokens, timed after
// warm-up steps. A row is "muster bf16" with muster's attention, or e.g.
// "muster bf16 (auto attention)", and is followed by a line naming the
// attention kernels that ran (with cuDNN's version). --cuda-graph on (the
// default, as the worker's train.cuda_graphs; or both: a row each)
// replays the worker's passes as CUDA graphs
// (GptModel::EnableCudaGraphs), rows "... + graph", whose line also
// counts the passes replayed. --zero-grad clear (or both) clears the
// gradients at each step's ZeroGrad (GptModel::SettleGrads), as the engine
// did before its Backward wrote over them (rows "... + cleared grads"; with
// both, a line after the pair says whether their last losses have the same
// bits, which they should). --backward-streams 2,1 (with graphs) runs the
// backward on that many streams (GptModel::SetBackwardStreams; 2, the
// worker's, by default), a row each (", N streams") and a line saying
// whether each row's last loss has the first row's bits, which it should.
// Then the same model trained
// by PyTorch on the same GPU (tools/bench_gpu_torch.py: eager bf16,
// torch.compile bf16, TF32, FP32), and a table of both. Without CUDA (a
// build without --config=cuda, or no GPU) it prints why and exits 1.
//
//   bazel build -c opt --config=cuda //tools:bench_gpu
//   bazel-bin/tools/bench_gpu [--precisions fp32,tf32,bf16] [--batch 8]
//       [--seq 1024] [--batches 8,16,32] [--attention auto,muster,gemm,cudnn]
//       [--cuda-graph on|off|both] [--zero-grad mark|clear|both]
//       [--backward-streams 2,1] [--no-torch]
//
// cuDNN's attention needs libcudnn.so.9 where the dynamic loader finds it
// (LD_LIBRARY_PATH or the system's paths); it is loaded only when asked for.
//
// The PyTorch peer runs as `python3` from PATH with LD_LIBRARY_PATH
// removed from its environment, bounded by --torch-timeout seconds.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/grad_norm.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"
#include "tools/bench_util.h"
#include "worker/model/model.h"
#include "worker/model/ops.h"
#include "worker/optim/optim.h"

namespace muster::worker {
namespace {

using tools::Median;

constexpr double kGB = 1e9;  // peak memory is printed in GB (10^9 bytes)

struct GpuResult {
  int batch = 0;
  std::string attention;   // GptModel::DescribeAttention after the steps
  long graph_replays = 0;  // passes replayed from CUDA graphs (with --cuda-graph)
  double ms_per_step = 0;  // median over the timed steps
  uint32_t last_loss_bits = 0;
  double min_ms = 0, max_ms = 0;
  double tokens_per_s = 0;
  double mfu = 0;        // 0 when the GPU's peak is unknown
  double peak_gb = 0;    // max CudaMemoryInUse() sampled (whole GPU)
  double before_gb = 0;  // CudaMemoryInUse() before the model was created
  float first_loss = 0, last_loss = 0;
  size_t parameters = 0;
};

ModelConfig Gpt2(int T) {
  ModelConfig config;
  config.layers = 12;
  config.dim = 768;
  config.heads = 12;
  config.vocab = 50257;
  config.seq_len = T;
  return config;
}

absl::StatusOr<GpuResult> Bench(const ModelConfig& config, Precision precision, Attention attention,
                                bool graphs, bool clear_grads, int streams, int B, int T,
                                int warmup, int steps, double peak) {
  GpuResult result;
  result.batch = B;
  size_t peak_bytes = 0;
  auto sample_memory = [&] {
    absl::StatusOr<size_t> used = CudaMemoryInUse();
    if (used.ok()) peak_bytes = std::max(peak_bytes, *used);
  };
  if (absl::StatusOr<size_t> before = CudaMemoryInUse(); before.ok()) {
    result.before_gb = *before / kGB;
  }

  auto created =
      GptModel::Create(config, B, Device::kCuda, precision, ParamStorage::kOwned, attention);
  if (!created.ok()) return created.status();
  std::unique_ptr<GptModel> model = *std::move(created);
  if (graphs) {
    if (absl::Status enabled = model->EnableCudaGraphs(); !enabled.ok()) return enabled;
    if (absl::Status set = model->SetBackwardStreams(streams); !set.ok()) return set;
  }
  model->InitWeights(1337);
  OptimConfig optim;  // lr 3e-4, betas (0.9, 0.95), eps 1e-8, no decay
  auto made = AdamW::Create(model.get(), optim);
  if (!made.ok()) return made.status();
  AdamW& adamw = **made;
  if (absl::Status status = model->DeviceStatus(); !status.ok()) return status;
  sample_memory();

  std::mt19937 rng(42);
  std::uniform_int_distribution<int> token(0, config.vocab - 1);
  std::vector<int> inputs(B * T), targets(B * T);  // (B, T)
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = token(rng);
    targets[i] = token(rng);
  }

  // One optimizer step, exactly as bench_train's; returns its loss. The
  // host copy of one parameter at the end waits for the step's last kernels
  // (AdamW, zeroing) on the default stream, so each step's host time is
  // the whole step.
  auto step = [&](int s) -> absl::StatusOr<float> {
    float loss = model->Forward(inputs.data(), targets.data(), B, T);
    model->Backward(1.0f);
    // As the trainer does: the clip factor folded into AdamW.
    const double norm = std::sqrt(model->GradSumOfSquares());
    adamw.Step(static_cast<float>(optim.lr), s + 1, kernels::ClipScale(norm, 1.0f));
    model->ZeroGrad();
    if (clear_grads) model->SettleGrads();
    float probe = 0;
    model->ops().ToHost(&probe, model->stages().front().params, sizeof(float));
    if (absl::Status status = model->DeviceStatus(); !status.ok()) return status;
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrFormat("loss is %f at step %d", loss, s));
    }
    return loss;
  };

  for (int s = 0; s < warmup; ++s) {
    absl::StatusOr<float> loss = step(s);
    if (!loss.ok()) return loss.status();
    if (s == 0) result.first_loss = *loss;
  }
  std::vector<double> ms;
  ms.reserve(steps);
  for (int s = 0; s < steps; ++s) {
    auto start = std::chrono::steady_clock::now();
    absl::StatusOr<float> loss = step(warmup + s);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
    if (!loss.ok()) return loss.status();
    if (warmup == 0 && s == 0) result.first_loss = *loss;
    result.last_loss = *loss;
    std::memcpy(&result.last_loss_bits, &*loss, sizeof(float));
  }
  sample_memory();

  result.ms_per_step = Median(ms);
  result.min_ms = ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end());
  result.max_ms = ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end());
  result.tokens_per_s = result.ms_per_step > 0 ? B * T / (result.ms_per_step / 1e3) : 0;
  result.mfu = peak > 0 ? FlopsPerToken(config, T) * result.tokens_per_s / peak : 0;
  result.peak_gb = peak_bytes / kGB;
  result.parameters = model->num_parameters();
  result.attention = model->DescribeAttention();
  result.graph_replays = model->graph_replays();
  return result;
}

std::string MfuText(double mfu) {
  return mfu > 0 ? absl::StrFormat("MFU %5.1f%%", 100 * mfu) : std::string("MFU n/a");
}

void PrintRow(const std::string& name, int T, const GpuResult& r) {
  std::printf(
      "%-16s B=%-3d T=%-4d %8.2f ms/step (min %.2f, max %.2f) %9.0f tok/s  %s  "
      "peak %.2f GB (%.2f before)  loss %.4f -> %.4f\n",
      name.c_str(), r.batch, T, r.ms_per_step, r.min_ms, r.max_ms, r.tokens_per_s,
      MfuText(r.mfu).c_str(), r.peak_gb, r.before_gb, r.first_loss, r.last_loss);
  std::fflush(stdout);
}

void PrintError(const std::string& name, int B, int T, const absl::Status& status) {
  std::printf("%-16s B=%-3d T=%-4d FAILED: %s\n", name.c_str(), B, T, status.ToString().c_str());
  std::fflush(stdout);
}

// A row's system: "muster bf16" with muster's attention, "muster bf16
// (cudnn attention)" with cuDNN's, "muster bf16 (auto attention)" with the
// worker's default; " + graph" with CUDA graphs; " + cleared grads" with
// --zero-grad clear; ", N streams" where --backward-streams lists several.
std::string SystemName(absl::string_view precision, Attention attention, bool graphs = false,
                       bool clear_grads = false, int streams = 0) {
  std::string name =
      attention == Attention::kMuster
          ? absl::StrCat("muster ", precision)
          : absl::StrCat("muster ", precision, " (", AttentionName(attention), " attention)");
  if (graphs) absl::StrAppend(&name, " + graph");
  if (clear_grads) absl::StrAppend(&name, " + cleared grads");
  if (streams > 0) absl::StrAppend(&name, ", ", streams, streams == 1 ? " stream" : " streams");
  return name;
}

// After a row: which attention kernels ran it, and with CUDA graphs how
// many passes were replayed.
void PrintAttention(Attention attention, const GpuResult& r, bool graphs = false) {
  std::printf("  attention: %s", r.attention.c_str());
  if (graphs) std::printf("; %ld passes replayed from CUDA graphs", r.graph_replays);
  std::printf("\n");
  std::fflush(stdout);
}

// ---- the PyTorch peer ----

// tools/bench_gpu_torch.py: in this binary's runfiles, or beside the binary
// (a bundle directory), or under the working directory.
std::string TorchScript(const char* argv0) {
  constexpr char kName[] = "bench_gpu_torch.py";
  std::vector<std::string> candidates;
  if (const char* dir = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(absl::StrCat(dir, "/muster/tools/", kName));
  }
  std::error_code error;
  auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    candidates.push_back(absl::StrCat(self.string(), ".runfiles/muster/tools/", kName));
    candidates.push_back((self.parent_path() / kName).string());
  }
  if (argv0 != nullptr) {
    std::filesystem::path invoked(argv0);
    candidates.push_back(absl::StrCat(invoked.string(), ".runfiles/muster/tools/", kName));
    candidates.push_back(
        (invoked.has_parent_path() ? invoked.parent_path() / kName : std::filesystem::path(kName))
            .string());
  }
  candidates.push_back(absl::StrCat("tools/", kName));
  for (const std::string& path : candidates) {
    if (access(path.c_str(), R_OK) == 0) return path;
  }
  return "";
}

// The value of "key" in one JSON object line as json.dumps writes it:
// a string's contents, or a number / null / true as text. nullopt if absent.
std::optional<std::string> JsonField(absl::string_view line, absl::string_view key) {
  std::string quoted = absl::StrCat("\"", key, "\"");
  size_t at = line.find(quoted);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(line.substr(at + quoted.size()));
  if (!absl::ConsumePrefix(&rest, ":")) return std::nullopt;
  rest = absl::StripLeadingAsciiWhitespace(rest);
  if (absl::ConsumePrefix(&rest, "\"")) {
    std::string value;
    for (size_t i = 0; i < rest.size(); ++i) {
      if (rest[i] == '\\' && i + 1 < rest.size()) {
        value.push_back(rest[++i]);  // \" \\ (other escapes kept as their letter)
      } else if (rest[i] == '"') {
        return value;
      } else {
        value.push_back(rest[i]);
      }
    }
    return std::nullopt;
  }
  size_t end = rest.find_first_of(",}");
  return std::string(absl::StripAsciiWhitespace(rest.substr(0, end)));
}

double JsonNumber(absl::string_view line, absl::string_view key) {
  std::optional<std::string> text = JsonField(line, key);
  double value;
  if (!text.has_value() || !absl::SimpleAtod(*text, &value)) return std::nan("");
  return value;
}

struct TorchRow {
  std::string mode;
  std::string error;  // set when the mode failed
  double ms_per_step = std::nan("");
  double tokens_per_s = std::nan("");
  double peak_gb = std::nan("");
  double loss = std::nan("");
};

struct TorchRun {
  std::string info;  // "PyTorch <version> on <device>"
  std::vector<TorchRow> rows;
};

// Runs the peer and parses its JSON lines. The child gets our environment
// less LD_LIBRARY_PATH, its own process group (killed on timeout and if we
// die), and `timeout`.
absl::StatusOr<TorchRun> RunTorch(const std::string& python, const std::string& script,
                                  const std::vector<std::string>& args, absl::Duration timeout) {
  launcher::SpawnSpec spec;
  spec.argv = {python, "-u", script};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  for (const auto& [key, value] : launcher::CurrentEnvironment()) {
    if (key == "LD_LIBRARY_PATH") continue;  // our bundle's libraries must not reach torch
    spec.env.push_back(absl::StrCat(key, "=", value));
  }
  spec.pipe_stdout = true;
  spec.pipe_stderr = true;
  std::printf("\nPyTorch: %s\n", absl::StrJoin(spec.argv, " ").c_str());
  std::fflush(stdout);
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  if (!child.ok()) return child.status();

  // Read both pipes until both close or the deadline passes; echo the
  // JSON lines as they come (the compile mode takes minutes).
  int fds[2] = {child->TakeStdout(), child->TakeStderr()};
  std::string out, err, pending;
  absl::Time deadline = absl::Now() + timeout;
  bool timed_out = false;
  while (fds[0] >= 0 || fds[1] >= 0) {
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      timed_out = true;
      break;
    }
    pollfd polls[2];
    for (int i = 0; i < 2; ++i) polls[i] = {fds[i], POLLIN, 0};  // fd -1: ignored
    int ready = poll(
        polls, 2, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000)));
    if (ready < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i] < 0 || (polls[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      char buffer[4096];
      ssize_t got = read(fds[i], buffer, sizeof(buffer));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        close(fds[i]);
        fds[i] = -1;
        continue;
      }
      if (i == 1) {
        err.append(buffer, got);
        continue;
      }
      out.append(buffer, got);
      pending.append(buffer, got);
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        std::printf("  [torch] %s\n", pending.substr(0, nl).c_str());
        pending.erase(0, nl + 1);
      }
      std::fflush(stdout);
    }
  }
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
  if (timed_out) child->SignalGroup(SIGKILL);
  std::optional<launcher::ExitInfo> exit = child->WaitFor(absl::Seconds(30));
  if (!exit.has_value()) {
    child->SignalGroup(SIGKILL);
    exit = child->WaitFor(absl::Seconds(10));
  }

  TorchRun run;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipWhitespace())) {
    line = absl::StripAsciiWhitespace(line);
    if (!absl::StartsWith(line, "{")) continue;
    if (std::optional<std::string> torch = JsonField(line, "torch"); torch.has_value()) {
      run.info = absl::StrCat("PyTorch ", *torch, " on ", JsonField(line, "device").value_or("?"));
      continue;
    }
    std::optional<std::string> mode = JsonField(line, "mode");
    if (!mode.has_value()) continue;
    TorchRow row;
    row.mode = *mode;
    row.error = JsonField(line, "error").value_or("");
    row.ms_per_step = JsonNumber(line, "ms_per_step");
    row.tokens_per_s = JsonNumber(line, "tok_per_s");
    row.peak_gb = JsonNumber(line, "peak_gb");
    row.loss = JsonNumber(line, "loss");
    if (row.error.empty() && !(row.ms_per_step > 0)) row.error = "no ms_per_step in its line";
    run.rows.push_back(row);
  }
  bool ok = exit.has_value() && exit->Succeeded() && !timed_out;
  if (!ok) {
    std::string tail = err.size() > 2000 ? "..." + err.substr(err.size() - 2000) : err;
    std::string why = timed_out          ? absl::StrCat("ran past ", absl::FormatDuration(timeout))
                      : exit.has_value() ? exit->Describe()
                                         : std::string("did not exit");
    absl::Status status = absl::InternalError(
        absl::StrCat("the PyTorch peer failed (", why, "); its stderr:\n", tail));
    if (run.rows.empty()) return status;
    // Keep the modes that finished before it failed.
    std::printf("PyTorch: %s\n", status.ToString().c_str());
  }
  return run;
}

Precision TorchPrecision(const std::string& mode) {
  if (absl::StartsWith(mode, "bf16")) return Precision::kBf16;
  if (mode == "tf32") return Precision::kTf32;
  return Precision::kFp32;
}

// ---- the final table ----

std::string Cell(double value, const char* format) {
  return std::isfinite(value) && value > 0 ? absl::StrFormat(format, value) : std::string("n/a");
}

void PrintTableRow(const std::string& system, double ms, double tokens_per_s, double peak_gb,
                   double mfu, double base_ms) {
  std::string ratio = base_ms > 0 && std::isfinite(ms) && ms > 0
                          ? absl::StrFormat("%.2f", ms / base_ms)
                          : std::string("n/a");
  std::printf("| %-22s | %9s | %9s | %7s | %6s | %13s |\n", system.c_str(),
              Cell(ms, "%.2f").c_str(), Cell(tokens_per_s, "%.0f").c_str(),
              Cell(peak_gb, "%.2f").c_str(), Cell(100 * mfu, "%.1f%%").c_str(), ratio.c_str());
}

std::vector<int> ParseInts(const std::string& list, bool* ok) {
  std::vector<int> values;
  *ok = true;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int value;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &value) || value <= 0) {
      *ok = false;
      return {};
    }
    values.push_back(value);
  }
  return values;
}

// A two-way option's rows: {false} for `off`, {true} for `on`, both for
// "both" (off first); for anything else none, and a message naming `flag`.
std::vector<bool> Modes(const char* flag, const std::string& value, const char* off,
                        const char* on) {
  std::vector<bool> modes;
  if (value == off || value == "both") modes.push_back(false);
  if (value == on || value == "both") modes.push_back(true);
  if (modes.empty()) {
    std::fprintf(stderr, "bench_gpu: %s wants %s, %s or both, got '%s'\n", flag, off, on,
                 value.c_str());
  }
  return modes;
}

int Main(int argc, char** argv) {
  std::string precisions = "fp32,tf32,bf16", batches, torch_modes, python = "python3";
  // The worker's defaults: attention auto, train.cuda_graphs on.
  std::string attention_list = "auto", graph_mode = "on", zero_grad = "mark", streams_list = "2";
  int B = 8, T = 1024, warmup = 3, steps = 20, torch_timeout = 600;
  bool no_torch = false;
  CLI::App app("bench_gpu: GPT-2 124M training throughput of the CUDA worker (and PyTorch's)");
  app.add_option("--precisions", precisions, "Comma-separated: fp32, tf32, bf16")
      ->capture_default_str();
  app.add_option("--batch", B, "Sequences per step")->capture_default_str();
  app.add_option("--seq", T, "Tokens per sequence (T)")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps (the median is reported)")->capture_default_str();
  app.add_option("--batches", batches,
                 "Also sweep these batch sizes in bf16, e.g. 8,16,32 (one row each)");
  app.add_option("--attention", attention_list,
                 "Comma-separated: auto (the worker's default: cuDNN's in bf16 where it "
                 "loads, else muster's), muster (muster's own kernels), gemm (muster's GEMM "
                 "attention, never flash), cudnn (cuDNN's fused attention, bf16 only); one row "
                 "each")
      ->capture_default_str();
  app.add_option("--cuda-graph", graph_mode,
                 "off, on or both: the worker's passes replayed as CUDA graphs "
                 "(GptModel::EnableCudaGraphs; captured in the second warm-up step, so "
                 "--warmup 2 or more); both: a row each")
      ->capture_default_str();
  app.add_option("--zero-grad", zero_grad,
                 "mark, clear or both: ZeroGrad only marks the gradients zero (the worker's "
                 "way: the next Backward writes over them), or also clears them (the engine's "
                 "way before); both: a row each")
      ->capture_default_str();
  app.add_option("--backward-streams", streams_list,
                 "Comma-separated, each 1 or 2: the streams of the backward with CUDA graphs "
                 "(GptModel::SetBackwardStreams; 2 is the worker's); more than one: a row each, "
                 "in that order, and whether each row's last loss has the first row's bits")
      ->capture_default_str();
  app.add_flag("--no-torch", no_torch, "No PyTorch comparison");
  app.add_option("--torch-modes", torch_modes,
                 "PyTorch modes (default: the script's, BENCH_GPU_TORCH_MODES or "
                 "bf16,bf16_compile,tf32,fp32)");
  app.add_option("--torch-timeout", torch_timeout, "Seconds the PyTorch run may take")
      ->capture_default_str();
  app.add_option("--python", python, "The PyTorch peer's interpreter (looked up on PATH)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (B <= 0 || T <= 0 || steps <= 0 || warmup < 0) {
    std::fprintf(stderr, "bench_gpu: --batch, --seq and --steps must be > 0, --warmup >= 0\n");
    return 2;
  }
  bool batches_ok = true;
  std::vector<int> sweep = ParseInts(batches, &batches_ok);
  if (!batches_ok) {
    std::fprintf(stderr, "bench_gpu: --batches wants positive integers, e.g. 8,16,32\n");
    return 2;
  }
  std::vector<Attention> attentions;
  for (absl::string_view item : absl::StrSplit(attention_list, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    if (item != "auto" && item != "muster" && item != "gemm" && item != "cudnn") {
      std::fprintf(stderr,
                   "bench_gpu: --attention wants auto, muster, gemm and/or cudnn, got '%s'\n",
                   std::string(item).c_str());
      return 2;
    }
    attentions.push_back(item == "cudnn"    ? Attention::kCudnn
                         : item == "gemm"   ? Attention::kGemm
                         : item == "muster" ? Attention::kMuster
                                            : Attention::kAuto);
  }
  if (attentions.empty()) {
    std::fprintf(stderr, "bench_gpu: --attention wants auto, muster, gemm and/or cudnn\n");
    return 2;
  }
  const std::vector<bool> graph_modes = Modes("--cuda-graph", graph_mode, "off", "on");
  const std::vector<bool> clear_modes = Modes("--zero-grad", zero_grad, "mark", "clear");
  if (graph_modes.empty() || clear_modes.empty()) return 2;
  bool streams_ok = true;
  const std::vector<int> stream_counts = ParseInts(streams_list, &streams_ok);
  if (!streams_ok || stream_counts.empty() ||
      std::any_of(stream_counts.begin(), stream_counts.end(), [](int n) { return n > 2; })) {
    std::fprintf(stderr, "bench_gpu: --backward-streams wants 1 and/or 2, e.g. 2,1\n");
    return 2;
  }

  absl::StatusOr<CudaDeviceInfo> device = GetCudaDeviceInfo(Precision::kFp32);
  if (!device.ok()) {
    std::fprintf(stderr, "bench_gpu: %s\n", device.status().ToString().c_str());
    return 1;
  }
  std::printf("bench_gpu: %s, %.1f GB; %s\n", device->name.c_str(), device->memory_total / kGB,
              absl::FormatTime("%Y-%m-%d %H:%M:%S %Z", absl::Now(), absl::LocalTimeZone()).c_str());
  std::printf(
      "GPT-2 124M (L=12 C=768 NH=12 V=50257), B=%d T=%d, %d warm-up + %d timed steps, "
      "median ms/step; peak memory: cudaMemGetInfo in use, whole GPU\n",
      B, T, warmup, steps);
  std::fflush(stdout);
  const ModelConfig config = Gpt2(T);

  auto peak_for = [](Precision precision) {
    absl::StatusOr<CudaDeviceInfo> info = GetCudaDeviceInfo(precision);
    return info.ok() ? info->peak_flops : 0.0;
  };

  // Rows of the final table, in order.
  struct Row {
    std::string system;
    double ms = std::nan(""), tokens_per_s = std::nan(""), peak_gb = std::nan(""), mfu = 0;
  };
  std::vector<Row> table;
  // The ratio's base: muster bf16 at --batch, with muster's attention when
  // --attention has it, else with the first one it has.
  double base_ms = 0;
  const int base_streams =
      graph_modes.front() && stream_counts.size() > 1 ? stream_counts.front() : 0;
  std::string base_system = SystemName("bf16", attentions.front(), graph_modes.front(),
                                       clear_modes.front(), base_streams);
  for (Attention attention : attentions) {
    if (attention == Attention::kMuster) {
      base_system =
          SystemName("bf16", attention, graph_modes.front(), clear_modes.front(), base_streams);
    }
  }

  for (absl::string_view item : absl::StrSplit(precisions, ',', absl::SkipWhitespace())) {
    std::string name(absl::StripAsciiWhitespace(item));
    absl::StatusOr<Precision> precision = ResolvePrecision(name, Device::kCuda);
    for (Attention attention : attentions) {
      for (const bool graphs : graph_modes) {
        std::optional<uint32_t> marked_loss_bits;  // of this pair's mark row
        for (const bool clear_grads : clear_modes) {
          std::optional<uint32_t> first_streams_bits;  // of this clear mode's first streams row
          for (const int streams : stream_counts) {
            // Without graphs the backward runs on one stream whatever
            // --backward-streams says: one row.
            if (!graphs && streams != stream_counts.front()) continue;
            const int named_streams = graphs && stream_counts.size() > 1 ? streams : 0;
            std::string system = SystemName(name, attention, graphs, clear_grads, named_streams);
            if (!precision.ok()) {
              PrintError(system, B, T, precision.status());
              table.push_back({system});
              continue;
            }
            system = SystemName(PrecisionName(*precision), attention, graphs, clear_grads,
                                named_streams);
            if (attention == Attention::kCudnn && *precision != Precision::kBf16) {
              std::printf("%-16s skipped: cuDNN's attention runs in bf16 only\n", system.c_str());
              std::fflush(stdout);
              continue;
            }
            // auto as the worker resolves it: kAuto in bf16 (the CUDA model
            // picks), muster's own in fp32 and tf32.
            const Attention runs = attention == Attention::kAuto
                                       ? ResolveAttention("auto", Device::kCuda, *precision).value()
                                       : attention;
            absl::StatusOr<GpuResult> result =
                Bench(config, *precision, runs, graphs, clear_grads, streams, B, T, warmup, steps,
                      peak_for(*precision));
            if (!result.ok()) {
              PrintError(system, B, T, result.status());
              table.push_back({system});
              continue;
            }
            PrintRow(system, T, *result);
            PrintAttention(attention, *result, graphs);
            if (!clear_grads && !first_streams_bits.has_value()) {
              marked_loss_bits = result->last_loss_bits;
            }
            if (clear_grads && marked_loss_bits.has_value() && !first_streams_bits.has_value()) {
              std::printf("  cleared against marked gradients: last losses %s\n",
                          *marked_loss_bits == result->last_loss_bits ? "bitwise equal" : "DIFFER");
              std::fflush(stdout);
            }
            if (first_streams_bits.has_value()) {
              std::printf(
                  "  %d backward streams against %d: last losses %s\n", streams,
                  stream_counts.front(),
                  *first_streams_bits == result->last_loss_bits ? "bitwise equal" : "DIFFER");
              std::fflush(stdout);
            } else {
              first_streams_bits = result->last_loss_bits;
            }
            table.push_back(
                {system, result->ms_per_step, result->tokens_per_s, result->peak_gb, result->mfu});
            if (system == base_system && base_ms == 0) base_ms = result->ms_per_step;
          }
        }
      }
    }
  }

  if (!sweep.empty()) {
    std::printf("\nbf16 batch sweep (T=%d):\n", T);
    for (Attention attention : attentions) {
      const std::string system = SystemName("bf16", attention, graph_modes.back());
      double best_tokens = 0;
      int best_batch = 0;
      for (int batch : sweep) {
        absl::StatusOr<GpuResult> result =
            Bench(config, Precision::kBf16, attention, graph_modes.back(), false,
                  stream_counts.front(), batch, T, warmup, steps, peak_for(Precision::kBf16));
        if (!result.ok()) {
          PrintError(system, batch, T, result.status());
          continue;
        }
        PrintRow(system, T, *result);
        if (result->tokens_per_s > best_tokens) {
          best_tokens = result->tokens_per_s;
          best_batch = batch;
        }
      }
      if (best_batch > 0) {
        const std::string which = attention == Attention::kMuster
                                      ? ""
                                      : absl::StrCat(" (", AttentionName(attention), " attention)");
        std::printf("bf16%s tok/s peaks at B=%d: %.0f tok/s\n", which.c_str(), best_batch,
                    best_tokens);
      }
    }
  }

  std::string torch_info;
  if (!no_torch) {
    std::string script = TorchScript(argc > 0 ? argv[0] : nullptr);
    if (script.empty()) {
      std::printf(
          "\nPyTorch: bench_gpu_torch.py not found in runfiles or beside the binary; "
          "skipping\n");
    } else {
      std::vector<std::string> args = {"--device", "cuda",
                                       "--batch",  std::to_string(B),
                                       "--seq",    std::to_string(T),
                                       "--steps",  std::to_string(steps),
                                       "--warmup", std::to_string(warmup)};
      if (!torch_modes.empty()) {
        args.push_back("--modes");
        args.push_back(torch_modes);
      }
      absl::StatusOr<TorchRun> run = RunTorch(python, script, args, absl::Seconds(torch_timeout));
      if (!run.ok()) {
        std::printf("PyTorch: %s\n", run.status().ToString().c_str());
      } else {
        torch_info = run->info;
        const double flops = FlopsPerToken(config, T);
        for (const TorchRow& row : run->rows) {
          std::string system = absl::StrCat("PyTorch ", row.mode);
          if (!row.error.empty()) {
            std::printf("%-22s FAILED: %s\n", system.c_str(), row.error.c_str());
            table.push_back({system});
            continue;
          }
          double peak = peak_for(TorchPrecision(row.mode));
          double mfu = peak > 0 && row.tokens_per_s > 0 ? flops * row.tokens_per_s / peak : 0;
          table.push_back({system, row.ms_per_step, row.tokens_per_s, row.peak_gb, mfu});
        }
      }
    }
  }

  std::printf("\n%s, B=%d T=%d%s%s\n", device->name.c_str(), B, T, torch_info.empty() ? "" : "; ",
              torch_info.c_str());
  std::printf(
      "ratio = system ms/step / %s ms/step (above 1: %s is faster); "
      "peak GB: muster's is the whole GPU in use (cudaMemGetInfo, with the CUDA "
      "context), PyTorch's torch.cuda.max_memory_allocated\n",
      base_system.c_str(), base_system.c_str());
  std::printf("| %-22s | %9s | %9s | %7s | %6s | %13s |\n", "system", "ms/step", "tok/s", "peak GB",
              "MFU", absl::StrCat("vs ", base_system).c_str());
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(24, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str(), std::string(9, '-').c_str(),
              std::string(8, '-').c_str(), std::string(15, '-').c_str());
  for (const Row& row : table) {
    PrintTableRow(row.system, row.ms, row.tokens_per_s, row.peak_gb, row.mfu, base_ms);
  }
  return 0;
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) { return muster::worker::Main(argc, argv); }
