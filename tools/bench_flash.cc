// The flash-attention kernels alone (kernels/fast/flash_attention.h) at
// GPT-2 124M's attention shape (B=8, T=1024, NH=12, head size 64, bf16,
// causal), for each compiled tiling of each kernel (flash_attention.h),
// rounds alternating between them: the median milliseconds of one forward
// and of one backward (delta, dK/dV and dQ kernels), and TFLOP/s counted as
// FlashAttention counts them (forward 4·B·NH·T²·hs / 2 for the causal
// half; backward 2.5× that). Then PyTorch's
// scaled_dot_product_attention(is_causal=True) on the same shape and GPU
// (tools/bench_flash_torch.py, `python3` from PATH), and the ratios.
//
//   bazel build -c opt --config=cuda //tools:bench_flash
//   bazel-bin/tools/bench_flash [--batch 8] [--seq 1024] [--heads 12]
//       [--rounds 5] [--iters 20] [--no-torch]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "kernels/bf16.h"
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

// One tiling timed: `ms` per round.
struct Variant {
  std::string name;
  FlashTiling tiling;
  std::vector<double> ms;
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

// "forward_ms=1.23 backward_ms=4.56" from the peer's log: the value of
// `key`, NaN if absent.
double PeerValue(const std::string& log, const std::string& key) {
  const size_t at = log.rfind(key + "=");
  if (at == std::string::npos) return std::nan("");
  const size_t begin = at + key.size() + 1;
  const size_t end = log.find_first_of(" \n", begin);
  double value;
  if (!absl::SimpleAtod(log.substr(begin, end - begin), &value)) return std::nan("");
  return value;
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
  void *qkv, *out, *dout, *dqkv;
  float *lse, *delta;
  Check(cudaMalloc(&qkv, qkv_n * 2), "cudaMalloc");
  Check(cudaMalloc(&dqkv, qkv_n * 2), "cudaMalloc");
  Check(cudaMalloc(&out, out_n * 2), "cudaMalloc");
  Check(cudaMalloc(&dout, out_n * 2), "cudaMalloc");
  Check(cudaMalloc(&lse, rows * 4), "cudaMalloc");
  Check(cudaMalloc(&delta, rows * 4), "cudaMalloc");
  const auto qkv_host = random_bf16(qkv_n), dout_host = random_bf16(out_n);
  Check(cudaMemcpy(qkv, qkv_host.data(), qkv_n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  Check(cudaMemcpy(dout, dout_host.data(), out_n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");

  // Forward: each compiled tiling, the default first. Backward: each dK/dV
  // tiling with dQ at the default (the default first), then each other dQ
  // tiling with dK/dV at the default.
  const FlashTiling base;
  std::vector<Variant> forwards, backwards;
  for (const FlashKernelTiling& t : std::vector<FlashKernelTiling>{
           {32, 64, false, 0}, {32, 32, false, 0}, {16, 64, false, 0}, {16, 32, false, 0}}) {
    FlashTiling tiling = base;
    tiling.forward = t;
    forwards.push_back({Describe(t, false), tiling, {}});
  }
  for (const FlashKernelTiling& t : std::vector<FlashKernelTiling>{{16, 32, true, 0},
                                                                   {16, 32, false, 0},
                                                                   {16, 64, true, 0},
                                                                   {16, 64, false, 0},
                                                                   {16, 16, false, 4},
                                                                   {32, 32, false, 0}}) {
    FlashTiling tiling = base;
    tiling.key_value = t;
    backwards.push_back({"dK/dV " + Describe(t, true), tiling, {}});
  }
  for (const FlashKernelTiling& t :
       std::vector<FlashKernelTiling>{{16, 32, false, 0}, {16, 16, false, 4}, {32, 32, false, 0}}) {
    FlashTiling tiling = base;
    tiling.query = t;
    backwards.push_back({"dQ " + Describe(t, false), tiling, {}});
  }
  auto forward = [&](const FlashTiling& tiling) {
    Check(FlashAttentionForward(out, lse, qkv, B, T, C, NH, nullptr, tiling), "forward");
  };
  auto backward = [&](const FlashTiling& tiling) {
    Check(FlashAttentionBackward(dqkv, delta, dout, out, qkv, lse, B, T, C, NH, nullptr, tiling),
          "backward");
  };
  for (Variant& v : forwards) forward(v.tiling);  // warm-up
  for (Variant& v : backwards) backward(v.tiling);
  Check(cudaDeviceSynchronize(), "warm-up");
  for (int r = 0; r < rounds; ++r) {
    // Alternate the order too, so no variant always follows the same one.
    for (size_t i = 0; i < forwards.size(); ++i) {
      Variant& v = forwards[r % 2 == 0 ? i : forwards.size() - 1 - i];
      v.ms.push_back(TimeCalls(iters, [&] { forward(v.tiling); }));
    }
    forward(base);  // the backward's out and lse
    for (size_t i = 0; i < backwards.size(); ++i) {
      Variant& v = backwards[r % 2 == 0 ? i : backwards.size() - 1 - i];
      v.ms.push_back(TimeCalls(iters, [&] { backward(v.tiling); }));
    }
  }

  const double forward_flop = 4.0 * B * NH * double(T) * T * kFlashHeadSize / 2;
  const double backward_flop = 2.5 * forward_flop;
  std::printf(
      "flash attention on %s: B=%d T=%d NH=%d hs=%d bf16 causal; %d "
      "rounds x %d calls\n",
      prop.name, B, T, NH, kFlashHeadSize, rounds, iters);
  std::printf("%-40s %10s %8s\n", "forward tiling (rows per warp, key step)", "ms", "TFLOP/s");
  for (const Variant& v : forwards) {
    const double ms = tools::Median(v.ms);
    std::printf("%-40s %10.4f %8.1f\n", v.name.c_str(), ms, forward_flop / ms / 1e9);
  }
  std::printf("%-40s %10s %8s\n", "backward (delta + dK/dV + dQ) tiling", "ms", "TFLOP/s");
  for (const Variant& v : backwards) {
    const double ms = tools::Median(v.ms);
    std::printf("%-40s %10.4f %8.1f\n", v.name.c_str(), ms, backward_flop / ms / 1e9);
  }
  const double ours_f = tools::Median(forwards[0].ms);
  const double ours_b = tools::Median(backwards[0].ms);
  if (no_torch) return 0;

  const std::string script = tools::BuiltFile("tools/bench_flash_torch.py");
  if (script.empty()) {
    std::printf("PyTorch: tools/bench_flash_torch.py not found; no comparison\n");
    return 0;
  }
  const std::string dir = tools::MakeTempDir("bench_flash");
  const std::string log = dir + "/torch.log";
  const absl::Status status = tools::RunLogged(
      {"env", "-u", "LD_LIBRARY_PATH", "python3", script, "--batch", std::to_string(B), "--seq",
       std::to_string(T), "--heads", std::to_string(NH), "--rounds", std::to_string(rounds),
       "--iters", std::to_string(iters)},
      log, absl::Seconds(300));
  const std::string text = tools::Slurp(log);
  if (!status.ok()) {
    std::printf("PyTorch: %s\n", std::string(status.message()).c_str());
    return 0;
  }
  const double peer_f = PeerValue(text, "forward_ms"), peer_b = PeerValue(text, "backward_ms");
  const size_t info = text.find("torch ");
  std::printf(
      "PyTorch SDPA (%s): forward %.3f ms (%.1f TFLOP/s), backward "
      "%.3f ms (%.1f TFLOP/s)\n",
      info == std::string::npos ? "?" : text.substr(info, text.find('\n', info) - info).c_str(),
      peer_f, forward_flop / peer_f / 1e9, peer_b, backward_flop / peer_b / 1e9);
  std::printf("muster (default tiling) / PyTorch time: forward %.2f, backward %.2f\n",
              ours_f / peer_f, ours_b / peer_b);
  return 0;
}

}  // namespace
}  // namespace muster::kernels::fast

int main(int argc, char** argv) { return muster::kernels::fast::Main(argc, argv); }
