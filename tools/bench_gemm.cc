// The GEMMs of one GPT-2 124M training step (B=8, T=1024, bf16) through
// the engine's cuBLASLt wrapper (kernels/fast/gemm.h), each against the
// other algorithms cuBLASLt's heuristic offers for it: is the algorithm
// the engine runs (the heuristic's first, asked for 16-byte-aligned
// operands) the fastest, and what would the others save per step?
//
// The calls are the model's own: the Gemm's Forward, BackwardInput and
// BackwardWeight are called as worker/model/model_cuda.cc calls them
// (the block's qkv, attention projection, fc with GELU, fc projection,
// and the tied LM head), recorded (Gemm::RecordCalls), and each recorded
// call is timed with the heuristic's first --algos algorithms, asked
// twice: with the 16-byte alignment the engine asks for, and with
// cuBLASLt's default of 256 bytes (this tool's buffers are 256-byte
// aligned; the model's activations are too, its weights not always).
// Each algorithm: --rounds rounds of --iters calls between CUDA events,
// the median round. Inputs are random (never zeros).
//
// Per call it prints the engine's algorithm (ms, TFLOP/s), the fastest
// of each query, and the saving per step (calls per step × the
// difference); then the sums: the step's GEMM time as the engine runs it,
// and with the fastest algorithm of each call. The peer, in the same run:
// PyTorch's torch.matmul of each call's m, n, k and layouts in bf16
// (tools/bench_gemm_torch.py, `python3` from PATH with LD_LIBRARY_PATH
// removed), a pure GEMM without the engine's epilogues or fp32
// accumulation, and the engine's time over it.
//
//   bazel build -c opt --config=cuda //tools:bench_gemm
//   bazel-bin/tools/bench_gemm [--batch 8] [--seq 1024] [--algos 16]
//       [--rounds 5] [--iters 10] [--no-torch]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/bf16.h"
#include "kernels/fast/gemm.h"
#include "tools/bench_util.h"

namespace muster::kernels::fast {
namespace {

void Check(int status, const char* what) {
  if (status == 0) return;
  std::fprintf(stderr, "bench_gemm: %s: error %d (%s)\n", what, status,
               status < (1 << 16) ? cudaGetErrorString(static_cast<cudaError_t>(status))
                                  : "cuBLAS status or no algorithm");
  std::exit(1);
}

// A device buffer of `bytes`, filled with random bf16 values in [-1, 1)
// (as floats' top halves, so an fp32 buffer holds small finite values
// too): a 4 MiB random block copied over and over.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    Check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    static const std::vector<uint16_t> block = [] {
      std::mt19937 rng(1234);
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      std::vector<uint16_t> b(2u << 20);
      for (uint16_t& x : b) x = Bf16FromFloat(dist(rng));
      return b;
    }();
    const size_t block_bytes = block.size() * sizeof(uint16_t);
    for (size_t at = 0; at < bytes; at += block_bytes) {
      Check(cudaMemcpy(static_cast<char*>(ptr_) + at, block.data(),
                       std::min(block_bytes, bytes - at), cudaMemcpyHostToDevice),
            "cudaMemcpy");
    }
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  float* f() const { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

// One of the step's GEMMs: its name, how often a step runs it, and the
// cuBLASLt calls it made (one, or two where a fused epilogue fell back).
struct StepGemm {
  std::string name;
  int per_step;
  std::vector<LtCall> calls;
};

std::string EpilogueName(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT:
      return "none";
    case CUBLASLT_EPILOGUE_BIAS:
      return "bias";
    case CUBLASLT_EPILOGUE_GELU_AUX:
      return "gelu aux";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
      return "gelu aux bias";
    case CUBLASLT_EPILOGUE_DGELU:
      return "dgelu";
    default:
      return absl::StrCat("epilogue ", static_cast<int>(e));
  }
}

// The fastest algorithm that ran, or null.
const Gemm::AlgorithmTime* Fastest(const std::vector<Gemm::AlgorithmTime>& times) {
  const Gemm::AlgorithmTime* best = nullptr;
  for (const Gemm::AlgorithmTime& t : times) {
    if (t.ms > 0 && (best == nullptr || t.ms < best->ms)) best = &t;
  }
  return best;
}

int Main(int argc, char** argv) {
  CLI::App app{"GPT-2 124M's GEMMs: the engine's cuBLASLt algorithm against the others"};
  int B = 8, T = 1024, algos = 16, rounds = 5, iters = 10;
  app.add_option("--batch", B, "Sequences")->capture_default_str();
  app.add_option("--seq", T, "Tokens per sequence (T)")->capture_default_str();
  app.add_option("--algos", algos, "Algorithms asked of the heuristic per query")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "Rounds per algorithm (the median is kept)")
      ->capture_default_str();
  app.add_option("--iters", iters, "Calls per round")->capture_default_str();
  bool no_torch = false;
  app.add_flag("--no-torch", no_torch, "No PyTorch comparison");
  CLI11_PARSE(app, argc, argv);
  if (B < 1 || T < 1 || algos < 1 || rounds < 1 || iters < 1) {
    std::fprintf(stderr, "bench_gemm: every option must be at least 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_gemm: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  // GPT-2 124M: C=768, 12 layers, V=50257 padded to 50304.
  const int C = 768, L = 12, Vp = 50304, BT = B * T;
  std::unique_ptr<Gemm> gemm;
  Check(Gemm::Create(GemmMath::kBf16, nullptr, &gemm), "Gemm::Create");
  const size_t widest = static_cast<size_t>(BT) * Vp * 2;  // the logits, bf16
  DeviceBuffer in(static_cast<size_t>(BT) * 4 * C * 2), out(widest), dout(widest),
      pre_gelu(static_cast<size_t>(BT) * 4 * C * 2), weight(static_cast<size_t>(Vp) * C * 2),
      bias(4 * C * 2), dweight(static_cast<size_t>(Vp) * C * 4);

  // The model's calls (worker/model/model_cuda.cc), recorded.
  std::vector<StepGemm> step;
  std::vector<LtCall> recorded;
  auto record = [&](const std::string& name, int per_step, auto&& fn) {
    recorded.clear();
    gemm->RecordCalls(&recorded);
    Check(fn(), name.c_str());
    gemm->RecordCalls(nullptr);
    step.push_back({name, per_step, recorded});
  };
  struct Linear {
    const char* name;
    int in, out;
    bool gelu;  // the fc layer: GELU fused after it
  };
  const Linear linears[] = {{"qkv", C, 3 * C, false},
                            {"attention projection", C, C, false},
                            {"fc + gelu", C, 4 * C, true},
                            {"fc projection", 4 * C, C, false}};
  for (const Linear& l : linears) {
    record(absl::StrCat(l.name, " forward"), L, [&] {
      return gemm->Forward(out.get(), l.gelu ? pre_gelu.get() : nullptr, in.get(), weight.get(),
                           bias.get(), BT, l.in, l.out);
    });
  }
  record("lm head forward", 1, [&] {
    return gemm->Forward(out.get(), nullptr, in.get(), weight.get(), nullptr, BT, C, Vp);
  });
  for (const Linear& l : linears) {
    // The fc projection's input gradient passes through the fc's GELU.
    const bool through_gelu = l.in == 4 * C;
    record(absl::StrCat(l.name, " dx", through_gelu ? " (dgelu)" : ""), L, [&] {
      return gemm->BackwardInput(out.get(), dout.get(), weight.get(),
                                 through_gelu ? pre_gelu.get() : nullptr, BT, l.in, l.out, 1.0f);
    });
    // Written over (beta 0), as a step's first Backward since ZeroGrad
    // writes every weight gradient.
    record(absl::StrCat(l.name, " dW"), L, [&] {
      return gemm->BackwardWeight(dweight.f(), GradWrite::kOverwrite, dout.get(), in.get(), BT,
                                  l.in, l.out, 1.0f);
    });
  }
  record("lm head dx", 1, [&] {
    return gemm->BackwardInput(out.get(), dout.get(), weight.get(), nullptr, BT, C, Vp, 1.0f);
  });
  record("lm head dW", 1, [&] {
    return gemm->BackwardWeight(dweight.f(), GradWrite::kOverwrite, dout.get(), in.get(), BT, C, Vp,
                                1.0f);
  });
  Check(static_cast<int>(cudaDeviceSynchronize()), "the recorded calls");

  // Every recorded call with each algorithm.
  struct Row {
    const StepGemm* gemm;
    LtCall call;
    double engine_ms = -1, best_ms = -1;
    std::vector<Gemm::AlgorithmTime> at16, at256;
    double torch_ms = std::nan("");
  };
  std::vector<Row> rows;
  for (const StepGemm& g : step) {
    for (const LtCall& call : g.calls) {
      Row row;
      row.gemm = &g;
      row.call = call;
      Check(gemm->TimeAlgorithms(call, algos, false, rounds, iters, &row.at16), g.name.c_str());
      Check(gemm->TimeAlgorithms(call, algos, true, rounds, iters, &row.at256), g.name.c_str());
      for (const Gemm::AlgorithmTime& t : row.at16) {
        if (t.same_as_run) row.engine_ms = t.ms;
      }
      row.best_ms = row.engine_ms;
      for (const std::vector<Gemm::AlgorithmTime>* times : {&row.at16, &row.at256}) {
        const Gemm::AlgorithmTime* b = Fastest(*times);
        if (b != nullptr && (row.best_ms < 0 || b->ms < row.best_ms)) row.best_ms = b->ms;
      }
      rows.push_back(std::move(row));
    }
  }

  // PyTorch's matmul of the same shapes and layouts (a pure bf16 GEMM).
  std::string torch_info = "no PyTorch comparison";
  if (!no_torch) {
    const std::string script = tools::BuiltFile("tools/bench_gemm_torch.py");
    if (script.empty()) {
      torch_info = "PyTorch: tools/bench_gemm_torch.py not found";
    } else {
      std::vector<std::string> argv = {"env",
                                       "-u",
                                       "LD_LIBRARY_PATH",
                                       "python3",
                                       script,
                                       "--rounds",
                                       std::to_string(rounds),
                                       "--iters",
                                       std::to_string(iters)};
      for (const Row& row : rows) {
        argv.push_back("--gemm");
        argv.push_back(absl::StrCat(row.call.m, ",", row.call.n, ",", row.call.k, ",",
                                    row.call.trans_a ? 1 : 0, ",", row.call.trans_b ? 1 : 0));
      }
      const std::string log = tools::MakeTempDir("bench_gemm") + "/torch.log";
      const absl::Status status = tools::RunLogged(argv, log, absl::Seconds(300));
      if (!status.ok()) {
        torch_info = absl::StrCat("PyTorch: ", status.message());
      } else {
        for (const absl::string_view line : absl::StrSplit(tools::Slurp(log), '\n')) {
          if (absl::StartsWith(line, "torch ")) torch_info = std::string(line);
          const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
          int index = -1;
          double ms = 0;
          if (fields.size() == 2 && absl::StartsWith(fields[0], "gemm=") &&
              absl::StartsWith(fields[1], "ms=") && absl::SimpleAtoi(fields[0].substr(5), &index) &&
              absl::SimpleAtod(fields[1].substr(3), &ms) && index >= 0 &&
              index < static_cast<int>(rows.size())) {
            rows[index].torch_ms = ms;
          }
        }
      }
    }
  }

  std::printf(
      "bench_gemm: %s, GPT-2 124M at B=%d T=%d, bf16; %d algorithms asked per query, "
      "median of %d rounds of %d calls; %s\n",
      prop.name, B, T, algos, rounds, iters, torch_info.c_str());
  std::printf(
      "engine = the algorithm the engine runs (the heuristic's first at 16-byte alignment); "
      "best16 / best256 = the fastest of the heuristic's list at 16 / 256-byte alignment (its "
      "index in that list); saving = per step, engine - fastest; torch = torch.matmul of the "
      "same m, n, k and layouts in bf16, without the engine's epilogue or fp32 accumulation\n\n");
  std::printf("| %-28s | %4s | %-22s | %-13s | %7s | %7s | %13s | %13s | %9s | %7s | %12s |\n",
              "gemm", "/step", "m x n x k", "epilogue", "engine", "TFLOP/s", "best16 (i)",
              "best256 (i)", "saving ms", "torch", "engine/torch");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(30, '-').c_str(),
              std::string(6, '-').c_str(), std::string(24, '-').c_str(),
              std::string(15, '-').c_str(), std::string(9, '-').c_str(),
              std::string(9, '-').c_str(), std::string(15, '-').c_str(),
              std::string(15, '-').c_str(), std::string(11, '-').c_str(),
              std::string(9, '-').c_str(), std::string(14, '-').c_str());
  double engine_total = 0, best_total = 0, torch_total = 0, torch_engine_total = 0;
  auto cell = [](const Gemm::AlgorithmTime* t) {
    return t == nullptr ? std::string("-") : absl::StrFormat("%.4f (%d)", t->ms, t->index);
  };
  auto number = [](bool ok, const char* format, double value) {
    return ok ? absl::StrFormat(format, value) : std::string("?");
  };
  for (const Row& row : rows) {
    const LtCall& call = row.call;
    const int per_step = row.gemm->per_step;
    const double flop = 2.0 * call.m * call.n * call.k * call.batch;
    const bool known = row.engine_ms > 0;
    const bool has_torch = std::isfinite(row.torch_ms) && row.torch_ms > 0;
    std::printf("| %-28s | %4d | %-22s | %-13s | %7s | %7s | %13s | %13s | %9s | %7s | %12s |\n",
                row.gemm->name.c_str(), per_step,
                absl::StrCat(call.m, " x ", call.n, " x ", call.k).c_str(),
                EpilogueName(call.epilogue).c_str(), number(known, "%.4f", row.engine_ms).c_str(),
                number(known, "%.0f", flop / row.engine_ms / 1e9).c_str(),
                cell(Fastest(row.at16)).c_str(), cell(Fastest(row.at256)).c_str(),
                number(known, "%.3f", per_step * (row.engine_ms - row.best_ms)).c_str(),
                number(has_torch, "%.4f", row.torch_ms).c_str(),
                number(known && has_torch, "%.2f", row.engine_ms / row.torch_ms).c_str());
    if (known) {
      engine_total += per_step * row.engine_ms;
      best_total += per_step * row.best_ms;
      if (has_torch) {
        torch_total += per_step * row.torch_ms;
        torch_engine_total += per_step * row.engine_ms;
      }
    }
  }
  std::printf(
      "\nGEMMs per step: %.2f ms with the engine's algorithms, %.2f ms with the fastest of each "
      "(saving %.2f ms)\n",
      engine_total, best_total, engine_total - best_total);
  if (torch_total > 0) {
    std::printf(
        "where PyTorch ran the same shapes: engine %.2f ms, torch.matmul %.2f ms a step "
        "(engine / torch %.2f)\n",
        torch_engine_total, torch_total, torch_engine_total / torch_total);
  }
  std::printf(
      "(\"?\": the engine's algorithm was not among the heuristic's first %d; raise "
      "--algos)\n",
      algos);
  return 0;
}

}  // namespace
}  // namespace muster::kernels::fast

int main(int argc, char** argv) { return muster::kernels::fast::Main(argc, argv); }
