// The flash-attention kernels alone (kernels/fast/flash_attention.h) at
// GPT-2 124M's attention shape (B=8, T=1024, NH=12, head size 64, bf16,
// causal), for each compiled tiling of each kernel (flash_attention.h),
// rounds alternating between them: the median milliseconds of one forward
// and of one backward (delta, dK/dV and dQ kernels; rows "stored dS": the
// dQ kernel a product of the dS the dK/dV kernel wrote and K, FlashTiling::
// stored_ds), and TFLOP/s counted as
// FlashAttention counts them (forward 4·B·NH·T²·hs / 2 for the causal
// half; backward 2.5× that). cuDNN's fused attention through
// kernels/fast/cudnn_attention.h is one more row of each table ("cudnn"),
// timed in the same alternating rounds; if cuDNN does not load or builds
// no plan, its error is printed once and the other rows go on without it.
// The tf32 kernels (fp32 activations, TF32 products: precision tf32) are
// rows too ("tf32 ..."), on fp32 copies of the same inputs.
// After the tables, cuDNN's version and the engines it picked. Then
// PyTorch's scaled_dot_product_attention(is_causal=True) on the same shape
// and GPU (tools/bench_flash_torch.py, `python3` from PATH): PyTorch's
// default choice and each backend on its own (flash, cuDNN, efficient;
// one that is unavailable is reported as such), each with its time ratios
// to muster's default tiling and to cuDNN through muster; then the same in
// fp32 with TF32 matmuls allowed (PyTorch's tf32 step), against muster's
// default tf32 tiling.
//
//   bazel build -c opt --config=cuda //tools:bench_flash
//   bazel-bin/tools/bench_flash [--batch 8] [--seq 1024] [--heads 12]
//       [--rounds 5] [--iters 20] [--no-torch]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/bf16.h"
#include "kernels/fast/cudnn_attention.h"
#include "kernels/fast/flash_attention.h"
#include "tools/bench_util.h"

namespace muster::kernels::fast {
namespace {

void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "bench_flash: %s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}
void Check(int status, const char* what) { Check(static_cast<cudaError_t>(status), what); }

// One tiling timed, or cuDNN (`cudnn`): `ms` per round. tf32 variants
// run on fp32 copies of the inputs.
struct Variant {
  std::string name;
  FlashTiling tiling;
  std::vector<double> ms;
  bool cudnn = false;
  FlashMath math = FlashMath::kBf16;
};

std::string Describe(const FlashKernelTiling& t, bool with_values) {
  std::string text = absl::StrCat(t.rows, " rows, step ", t.step);
  if (with_values) absl::StrAppend(&text, t.values_in_registers ? ", V in regs" : ", V in smem");
  if (t.blocks_per_sm > 0) absl::StrAppend(&text, ", ", t.blocks_per_sm, " blocks/SM");
  return text;
}

// Milliseconds per call of `fn`, over `iters` calls between two events.
template <typename Fn>
double TimeCalls(int iters, Fn&& fn) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  Check(cudaEventRecord(start), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) fn();
  Check(cudaEventRecord(stop), "cudaEventRecord");
  Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / iters;
}

// One line of the peer's log (tools/bench_flash_torch.py):
//   sdpa=<backend> kernel=<kernel> forward_ms=<ms> backward_ms=<ms>
//   sdpa=<backend> unavailable: <why>
struct PeerRow {
  std::string backend, kernel, unavailable;
  double forward_ms = std::nan(""), backward_ms = std::nan("");
};

// The rows of the peer's log, in its order, and its "torch <version> on
// <device>" line (`info`). Lines of neither kind (warnings) are skipped.
std::vector<PeerRow> ParsePeer(const std::string& log, std::string* info) {
  std::vector<PeerRow> rows;
  for (const absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StartsWith(line, "torch ")) {
      *info = std::string(line);
      continue;
    }
    if (!absl::StartsWith(line, "sdpa=")) continue;
    PeerRow row;
    const size_t unavailable = line.find(" unavailable:");
    if (unavailable != absl::string_view::npos) {
      row.backend = std::string(line.substr(5, unavailable - 5));
      row.unavailable = std::string(absl::StripAsciiWhitespace(line.substr(unavailable + 13)));
      rows.push_back(row);
      continue;
    }
    for (const absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      const size_t eq = field.find('=');
      if (eq == absl::string_view::npos) continue;
      const absl::string_view key = field.substr(0, eq), value = field.substr(eq + 1);
      if (key == "sdpa") row.backend = std::string(value);
      if (key == "kernel") row.kernel = std::string(value);
      if (key == "forward_ms" && !absl::SimpleAtod(value, &row.forward_ms)) {
        row.forward_ms = std::nan("");
      }
      if (key == "backward_ms" && !absl::SimpleAtod(value, &row.backward_ms)) {
        row.backward_ms = std::nan("");
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// What the peer is run at, and the FLOP counts for its TFLOP/s.
struct PeerShape {
  int B, T, NH, rounds, iters;
  double forward_flop, backward_flop;
};

// Runs tools/bench_flash_torch.py (`script`) in `dtype` and prints its
// rows, each with the time ratios of `ours` (muster's forward and
// backward ms) and `cudnn` (cuDNN through muster; NaN: none) to the
// row's, then `ours_name` / PyTorch's own choice.
void ComparePeer(const std::string& script, const std::string& dtype, const PeerShape& p,
                 std::pair<double, double> ours, std::pair<double, double> cudnn,
                 const std::string& ours_name) {
  const auto [ours_f, ours_b] = ours;
  const auto [cudnn_f, cudnn_b] = cudnn;
  const bool cudnn_timed = std::isfinite(cudnn_f) && std::isfinite(cudnn_b);
  const double forward_flop = p.forward_flop, backward_flop = p.backward_flop;
  const std::string dir = tools::MakeTempDir("bench_flash");
  const std::string log = dir + "/torch_" + dtype + ".log";
  const absl::Status status = tools::RunLogged(
      {"env", "-u", "LD_LIBRARY_PATH", "python3", script, "--batch", std::to_string(p.B), "--seq",
       std::to_string(p.T), "--heads", std::to_string(p.NH), "--rounds", std::to_string(p.rounds),
       "--iters", std::to_string(p.iters), "--dtype", dtype},
      log, absl::Seconds(300));
  const std::string text = tools::Slurp(log);
  if (!status.ok()) {
    std::printf("PyTorch: %s\n", std::string(status.message()).c_str());
    return;
  }
  std::string info;
  const std::vector<PeerRow> peers = ParsePeer(text, &info);
  if (peers.empty()) {
    std::printf("PyTorch: no sdpa= lines in its output (%s)\n", log.c_str());
    return;
  }
  // Time ratios: muster's default tiling, and cuDNN through muster, over
  // each PyTorch row's ("-" where either is missing).
  auto ratio = [](double ours, double theirs) {
    return std::isfinite(ours) && std::isfinite(theirs) && theirs > 0
               ? absl::StrFormat("%.2f", ours / theirs)
               : std::string("-");
  };
  std::printf("PyTorch SDPA: %s\n", info.empty() ? "?" : info.c_str());
  std::printf("%-40s %10s %8s %10s %8s %8s %8s %8s %8s\n", "PyTorch SDPA backend (kernel run)",
              "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "mu/it f", "mu/it b", "cd/it f", "cd/it b");
  const PeerRow* chosen = nullptr;  // PyTorch's default choice
  for (const PeerRow& row : peers) {
    std::string name = row.backend;
    if (!row.kernel.empty() && row.kernel != row.backend) {
      absl::StrAppend(&name, " (", row.kernel, ")");
    }
    if (!row.unavailable.empty()) {
      std::printf("%-40s unavailable: %s\n", name.c_str(), row.unavailable.c_str());
      continue;
    }
    if (row.backend == "default") chosen = &row;
    std::printf("%-40s %10.4f %8.1f %10.4f %8.1f %8s %8s %8s %8s\n", name.c_str(), row.forward_ms,
                forward_flop / row.forward_ms / 1e9, row.backward_ms,
                backward_flop / row.backward_ms / 1e9, ratio(ours_f, row.forward_ms).c_str(),
                ratio(ours_b, row.backward_ms).c_str(), ratio(cudnn_f, row.forward_ms).c_str(),
                ratio(cudnn_b, row.backward_ms).c_str());
  }
  std::printf(
      "(mu/it, cd/it: the time of %s, of cuDNN through muster, over the row's; f forward, b "
      "backward)\n",
      ours_name.c_str());
  if (chosen != nullptr) {
    std::printf("%s / PyTorch (%s) time: forward %.2f, backward %.2f\n", ours_name.c_str(),
                dtype.c_str(), ours_f / chosen->forward_ms, ours_b / chosen->backward_ms);
    if (cudnn_timed) {
      std::printf("cudnn (CudnnAttention) / PyTorch time: forward %.2f, backward %.2f\n",
                  cudnn_f / chosen->forward_ms, cudnn_b / chosen->backward_ms);
    }
  }
}

int Main(int argc, char** argv) {
  CLI::App app{
      "Flash attention kernels: ms and TFLOP/s per tiling, against "
      "PyTorch SDPA"};
  int B = 8, T = 1024, NH = 12, rounds = 5, iters = 20;
  bool no_torch = false;
  app.add_option("--batch", B, "Sequences")->capture_default_str();
  app.add_option("--seq", T, "Tokens per sequence (T)")->capture_default_str();
  app.add_option("--heads", NH, "Heads (head size 64)")->capture_default_str();
  app.add_option("--rounds", rounds, "Rounds, alternating the tilings")->capture_default_str();
  app.add_option("--iters", iters, "Calls timed per round")->capture_default_str();
  app.add_flag("--no-torch", no_torch, "No PyTorch comparison");
  CLI11_PARSE(app, argc, argv);
  if (B <= 0 || T <= 0 || NH <= 0 || rounds <= 0 || iters <= 0) {
    std::fprintf(stderr,
                 "bench_flash: --batch, --seq, --heads, --rounds, "
                 "--iters must be > 0\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_flash: FAILED_PRECONDITION: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const int C = NH * kFlashHeadSize;
  const size_t qkv_n = size_t(B) * T * 3 * C, out_n = size_t(B) * T * C;
  const size_t rows = size_t(B) * NH * T;

  // Random bf16 inputs (the timing does not depend on the values, as long
  // as they are finite).
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_bf16 = [&](size_t n) {
    std::vector<uint16_t> bits(n);
    for (auto& b : bits) b = Bf16FromFloat(normal(rng));
    return bits;
  };
  void *qkv, *out, *dout, *dqkv, *cudnn_out;
  float *lse, *delta, *cudnn_stats, *cudnn_sum;
  // The tf32 kernels' fp32 inputs (the same values), outputs and lse.
  float *qkv32, *out32, *dout32, *dqkv32, *lse32;
  Check(cudaMalloc(&qkv32, qkv_n * 4), "cudaMalloc");
  Check(cudaMalloc(&dqkv32, qkv_n * 4), "cudaMalloc");
  Check(cudaMalloc(&out32, out_n * 4), "cudaMalloc");
  Check(cudaMalloc(&dout32, out_n * 4), "cudaMalloc");
  Check(cudaMalloc(&lse32, rows * 4), "cudaMalloc");
  Check(cudaMalloc(&qkv, qkv_n * 2), "cudaMalloc");
  Check(cudaMalloc(&dqkv, qkv_n * 2), "cudaMalloc");
  Check(cudaMalloc(&out, out_n * 2), "cudaMalloc");
  Check(cudaMalloc(&dout, out_n * 2), "cudaMalloc");
  Check(cudaMalloc(&lse, rows * 4), "cudaMalloc");
  // cuDNN's own out and statistics (natural-log, not the flash kernels'
  // log2 form), which its backward reads.
  Check(cudaMalloc(&cudnn_out, out_n * 2), "cudaMalloc");
  Check(cudaMalloc(&cudnn_stats, rows * 4), "cudaMalloc");
  Check(cudaMalloc(&cudnn_sum, rows * 4), "cudaMalloc");
  const auto qkv_host = random_bf16(qkv_n), dout_host = random_bf16(out_n);
  Check(cudaMemcpy(qkv, qkv_host.data(), qkv_n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(dout, dout_host.data(), out_n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  auto widen = [](const std::vector<uint16_t>& bits) {
    std::vector<float> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) values[i] = FloatFromBf16(bits[i]);
    return values;
  };
  Check(cudaMemcpy(qkv32, widen(qkv_host).data(), qkv_n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(dout32, widen(dout_host).data(), out_n * 4, cudaMemcpyHostToDevice),
        "cudaMemcpy");

  // Forward: each compiled tiling, the default first. Backward: the
  // default (a stored dS) first; then dQ recomputed, each dK/dV tiling
  // with dQ 16/64, and each other dQ tiling with dK/dV 16/32 (values in
  // registers); then the other stored-dS pairings. Then cuDNN in each, if
  // it runs.
  const FlashTiling base;
  std::vector<Variant> forwards, backwards;
  for (const FlashKernelTiling& t : std::vector<FlashKernelTiling>{
           {32, 64, false, 0}, {32, 32, false, 0}, {16, 64, false, 0}, {16, 32, false, 0}}) {
    FlashTiling tiling = base;
    tiling.forward = t;
    forwards.push_back({Describe(t, false), tiling, {}});
  }
  auto stored_name = [](const FlashTiling& t) {
    return "stored dS, dK/dV " + Describe(t.key_value, true) + ", dQ " + Describe(t.query, false);
  };
  backwards.push_back({stored_name(base), base, {}});
  FlashTiling recompute = base;
  recompute.stored_ds = false;
  recompute.key_value = {16, 32, true, 0};
  recompute.query = {16, 64, false, 0};
  for (const FlashKernelTiling& t : std::vector<FlashKernelTiling>{{16, 32, true, 0},
                                                                   {16, 32, false, 0},
                                                                   {16, 64, true, 0},
                                                                   {16, 64, false, 0},
                                                                   {16, 16, false, 4},
                                                                   {32, 32, false, 0}}) {
    FlashTiling tiling = recompute;
    tiling.key_value = t;
    backwards.push_back({"dK/dV " + Describe(t, true), tiling, {}});
  }
  for (const FlashKernelTiling& t :
       std::vector<FlashKernelTiling>{{16, 32, false, 0}, {16, 16, false, 4}, {32, 32, false, 0}}) {
    FlashTiling tiling = recompute;
    tiling.query = t;
    backwards.push_back({"dQ " + Describe(t, false), tiling, {}});
  }
  for (const auto& [key_value, query] :
       std::vector<std::pair<FlashKernelTiling, FlashKernelTiling>>{
           {{16, 32, true, 3}, {16, 64, false, 0}},
           {{16, 32, false, 0}, {16, 64, false, 0}},
           {{16, 32, false, 0}, {32, 64, false, 0}}}) {
    FlashTiling tiling = base;
    tiling.key_value = key_value;
    tiling.query = query;
    backwards.push_back({stored_name(tiling), tiling, {}});
  }
  // tf32 (fp32 activations, TF32 products): each compiled tiling, the
  // default first, in the same rounds; timed against no peer.
  const FlashTiling base32 = FlashDefaultTiling(FlashMath::kTf32);
  for (const FlashKernelTiling& t :
       std::vector<FlashKernelTiling>{{32, 32, false, 0}, {16, 64, false, 0}, {16, 32, false, 0}}) {
    FlashTiling tiling = base32;
    tiling.forward = t;
    forwards.push_back({"tf32 " + Describe(t, false), tiling, {}, false, FlashMath::kTf32});
  }
  for (const FlashKernelTiling& t :
       std::vector<FlashKernelTiling>{{32, 16, false, 0}, {16, 32, false, 0}, {16, 16, false, 0}}) {
    FlashTiling tiling = base32;
    tiling.key_value = t;
    backwards.push_back({"tf32 dK/dV " + Describe(t, true), tiling, {}, false, FlashMath::kTf32});
  }
  {
    FlashTiling tiling = base32;
    tiling.query = {16, 16, false, 0};
    backwards.push_back(
        {"tf32 dQ " + Describe(tiling.query, false), tiling, {}, false, FlashMath::kTf32});
  }
  size_t scratch_floats = 0;
  for (const Variant& v : backwards) {
    const size_t floats = FlashAttentionBackwardScratchFloats(v.math, B, T, NH, v.tiling);
    if (floats == 0) {
      std::fprintf(stderr, "bench_flash: %s: not a compiled tiling\n", v.name.c_str());
      return 1;
    }
    scratch_floats = std::max(scratch_floats, floats);
  }
  Check(cudaMalloc(&delta, scratch_floats * 4), "cudaMalloc");
  std::printf("backward scratch: %.1f MB (delta, and a stored dS)\n", scratch_floats * 4 / 1e6);
  auto forward = [&](const FlashTiling& tiling, FlashMath math = FlashMath::kBf16) {
    if (math == FlashMath::kTf32) {
      Check(FlashAttentionForward(math, out32, lse32, qkv32, B, T, C, NH, nullptr, tiling),
            "tf32 forward");
      return;
    }
    Check(FlashAttentionForward(math, out, lse, qkv, B, T, C, NH, nullptr, tiling), "forward");
  };
  auto backward = [&](const FlashTiling& tiling, FlashMath math = FlashMath::kBf16) {
    if (math == FlashMath::kTf32) {
      Check(FlashAttentionBackward(math, dqkv32, delta, dout32, out32, qkv32, lse32, B, T, C, NH,
                                   nullptr, tiling),
            "tf32 backward");
      return;
    }
    Check(FlashAttentionBackward(math, dqkv, delta, dout, out, qkv, lse, B, T, C, NH, nullptr,
                                 tiling),
          "backward");
  };

  // cuDNN: loaded, and its plans built, on the first calls. A failure then
  // or later is printed once and drops its rows; the others go on.
  CudnnAttention cudnn;
  std::string cudnn_error;  // why cuDNN has no rows; empty while it runs
  auto cudnn_status = [&](int status, const char* what) {
    if (status == 0 || !cudnn_error.empty()) return;
    cudnn_error = absl::StrCat(what, " returned ", status);
    if (status != kCudnnError) {
      absl::StrAppend(&cudnn_error, " (", cudaGetErrorString(static_cast<cudaError_t>(status)),
                      ")");
    }
    absl::StrAppend(&cudnn_error, ": ", cudnn.error().empty() ? "no message" : cudnn.error());
    std::printf("cudnn: %s; no cudnn rows\n", cudnn_error.c_str());
    std::fflush(stdout);
  };
  auto cudnn_forward = [&] {
    if (!cudnn_error.empty()) return;
    cudnn_status(cudnn.Forward(cudnn_out, cudnn_stats, qkv, B, T, C, NH, nullptr),
                 "CudnnAttention::Forward");
  };
  auto cudnn_backward = [&] {
    if (!cudnn_error.empty()) return;
    cudnn_status(
        cudnn.Backward(dqkv, cudnn_sum, dout, cudnn_out, qkv, cudnn_stats, B, T, C, NH, nullptr),
        "CudnnAttention::Backward");
  };
  if (!CudnnAttentionSupports(ActType::kBf16, C, NH)) {
    cudnn_error = "CudnnAttentionSupports says no to this shape";
    std::printf("cudnn: %s; no cudnn rows\n", cudnn_error.c_str());
  }
  cudnn_forward();
  cudnn_backward();
  if (cudnn_error.empty()) {
    Variant row;
    row.name = "cudnn (CudnnAttention)";
    row.cudnn = true;
    forwards.push_back(row);
    backwards.push_back(row);
  }
  auto run_forward = [&](const Variant& v) {
    if (v.cudnn) {
      cudnn_forward();
    } else {
      forward(v.tiling, v.math);
    }
  };
  auto run_backward = [&](const Variant& v) {
    if (v.cudnn) {
      cudnn_backward();
    } else {
      backward(v.tiling, v.math);
    }
  };

  for (Variant& v : forwards) run_forward(v);  // warm-up
  forward(base);
  forward(base32, FlashMath::kTf32);
  cudnn_forward();
  for (Variant& v : backwards) run_backward(v);
  Check(cudaDeviceSynchronize(), "warm-up");
  for (int r = 0; r < rounds; ++r) {
    // Alternate the order too, so no variant always follows the same one.
    for (size_t i = 0; i < forwards.size(); ++i) {
      Variant& v = forwards[r % 2 == 0 ? i : forwards.size() - 1 - i];
      v.ms.push_back(TimeCalls(iters, [&] { run_forward(v); }));
    }
    forward(base);                      // the backward's out and lse
    forward(base32, FlashMath::kTf32);  // tf32's
    cudnn_forward();                    // and cuDNN's
    for (size_t i = 0; i < backwards.size(); ++i) {
      Variant& v = backwards[r % 2 == 0 ? i : backwards.size() - 1 - i];
      v.ms.push_back(TimeCalls(iters, [&] { run_backward(v); }));
    }
  }
  const bool cudnn_timed = cudnn_error.empty();

  const double forward_flop = 4.0 * B * NH * double(T) * T * kFlashHeadSize / 2;
  const double backward_flop = 2.5 * forward_flop;
  std::printf(
      "flash attention on %s: B=%d T=%d NH=%d hs=%d bf16 causal; %d "
      "rounds x %d calls\n",
      prop.name, B, T, NH, kFlashHeadSize, rounds, iters);
  double cudnn_f = std::nan(""), cudnn_b = std::nan("");
  std::printf("%-40s %10s %8s\n", "forward tiling (rows per warp, key step)", "ms", "TFLOP/s");
  for (const Variant& v : forwards) {
    if (v.cudnn && !cudnn_timed) continue;  // failed mid-run: printed above
    const double ms = tools::Median(v.ms);
    if (v.cudnn) cudnn_f = ms;
    std::printf("%-40s %10.4f %8.1f\n", v.name.c_str(), ms, forward_flop / ms / 1e9);
  }
  std::printf("%-40s %10s %8s\n", "backward (delta + dK/dV + dQ) tiling", "ms", "TFLOP/s");
  for (const Variant& v : backwards) {
    if (v.cudnn && !cudnn_timed) continue;
    const double ms = tools::Median(v.ms);
    if (v.cudnn) cudnn_b = ms;
    std::printf("%-40s %10.4f %8.1f\n", v.name.c_str(), ms, backward_flop / ms / 1e9);
  }
  const double ours_f = tools::Median(forwards[0].ms);
  const double ours_b = tools::Median(backwards[0].ms);
  if (cudnn_timed) {
    std::printf("cudnn: cuDNN %ld, workspace %zu bytes, engines:\n", cudnn.version(),
                cudnn.workspace_bytes());
    for (const absl::string_view line : absl::StrSplit(cudnn.Describe(), '\n', absl::SkipEmpty())) {
      std::printf("  %s\n", std::string(line).c_str());
    }
    std::printf("muster (default tiling) / cudnn time: forward %.2f, backward %.2f\n",
                ours_f / cudnn_f, ours_b / cudnn_b);
  } else {
    std::printf("cudnn: not timed (%s)\n", cudnn_error.c_str());
  }
  std::fflush(stdout);
  if (no_torch) return 0;

  const std::string script = tools::BuiltFile("tools/bench_flash_torch.py");
  if (script.empty()) {
    std::printf("PyTorch: tools/bench_flash_torch.py not found; no comparison\n");
    return 0;
  }
  const PeerShape shape{B, T, NH, rounds, iters, forward_flop, backward_flop};
  ComparePeer(script, "bfloat16", shape, {ours_f, ours_b}, {cudnn_f, cudnn_b},
              "muster (default tiling)");
  // tf32: the first tf32 row of each table is its default tiling.
  double tf32_f = std::nan(""), tf32_b = std::nan("");
  for (const Variant& v : forwards) {
    if (v.math == FlashMath::kTf32) {
      tf32_f = tools::Median(v.ms);
      break;
    }
  }
  for (const Variant& v : backwards) {
    if (v.math == FlashMath::kTf32) {
      tf32_b = tools::Median(v.ms);
      break;
    }
  }
  ComparePeer(script, "float32", shape, {tf32_f, tf32_b}, {std::nan(""), std::nan("")},
              "muster tf32 (default tiling)");
  return 0;
}

}  // namespace
}  // namespace muster::kernels::fast

int main(int argc, char** argv) { return muster::kernels::fast::Main(argc, argv); }
