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
// and with the fastest algorithm of each call. No PyTorch peer: this
// compares cuBLASLt's algorithms with each other (bench_gpu compares the
// whole step with PyTorch's).
//
//   bazel build -c opt --config=cuda //tools:bench_gemm
//   bazel-bin/tools/bench_gemm [--batch 8] [--seq 1024] [--algos 16]
//       [--rounds 5] [--iters 10]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/bf16.h"
#include "kernels/fast/gemm.h"

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
    record(absl::StrCat(l.name, " dW"), L, [&] {
      return gemm->BackwardWeight(dweight.f(), dout.get(), in.get(), BT, l.in, l.out, 1.0f);
    });
  }
  record("lm head dx", 1, [&] {
    return gemm->BackwardInput(out.get(), dout.get(), weight.get(), nullptr, BT, C, Vp, 1.0f);
  });
  record("lm head dW", 1,
         [&] { return gemm->BackwardWeight(dweight.f(), dout.get(), in.get(), BT, C, Vp, 1.0f); });
  Check(static_cast<int>(cudaDeviceSynchronize()), "the recorded calls");

  std::printf(
      "bench_gemm: %s, GPT-2 124M at B=%d T=%d, bf16; %d algorithms asked per query, "
      "median of %d rounds of %d calls\n",
      prop.name, B, T, algos, rounds, iters);
  std::printf(
      "engine = the algorithm the engine runs (heuristic's first at 16-byte alignment); "
      "best16 / best256 = the fastest of the heuristic's list at 16 / 256-byte alignment "
      "(index in that list); saving = per step, engine - fastest\n\n");
  std::printf("| %-28s | %4s | %-22s | %-15s | %7s | %7s | %13s | %13s | %9s |\n", "gemm", "/step",
              "m x n x k", "epilogue", "engine", "TFLOP/s", "best16 (i)", "best256 (i)",
              "saving ms");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(30, '-').c_str(),
              std::string(6, '-').c_str(), std::string(24, '-').c_str(),
              std::string(17, '-').c_str(), std::string(9, '-').c_str(),
              std::string(9, '-').c_str(), std::string(15, '-').c_str(),
              std::string(15, '-').c_str(), std::string(11, '-').c_str());
  double engine_total = 0, best_total = 0;
  for (const StepGemm& g : step) {
    for (const LtCall& call : g.calls) {
      std::vector<Gemm::AlgorithmTime> at16, at256;
      Check(gemm->TimeAlgorithms(call, algos, false, rounds, iters, &at16), g.name.c_str());
      Check(gemm->TimeAlgorithms(call, algos, true, rounds, iters, &at256), g.name.c_str());
      const Gemm::AlgorithmTime* engine = nullptr;
      for (const Gemm::AlgorithmTime& t : at16) {
        if (t.same_as_run) engine = &t;
      }
      const Gemm::AlgorithmTime* best16 = Fastest(at16);
      const Gemm::AlgorithmTime* best256 = Fastest(at256);
      const double flop = 2.0 * call.m * call.n * call.k * call.batch;
      const double engine_ms = engine != nullptr ? engine->ms : -1;
      double best_ms = engine_ms;
      for (const Gemm::AlgorithmTime* b : {best16, best256}) {
        if (b != nullptr && (best_ms < 0 || b->ms < best_ms)) best_ms = b->ms;
      }
      auto cell = [](const Gemm::AlgorithmTime* t) {
        return t == nullptr ? std::string("-") : absl::StrFormat("%.4f (%d)", t->ms, t->index);
      };
      const std::string shape = absl::StrCat(call.m, " x ", call.n, " x ", call.k);
      std::printf("| %-28s | %4d | %-22s | %-15s | %7s | %7s | %13s | %13s | %9s |\n",
                  g.name.c_str(), g.per_step, shape.c_str(), EpilogueName(call.epilogue).c_str(),
                  engine_ms > 0 ? absl::StrFormat("%.4f", engine_ms).c_str() : "?",
                  engine_ms > 0 ? absl::StrFormat("%.0f", flop / engine_ms / 1e9).c_str() : "?",
                  cell(best16).c_str(), cell(best256).c_str(),
                  engine_ms > 0
                      ? absl::StrFormat("%.3f", g.per_step * (engine_ms - best_ms)).c_str()
                      : "?");
      if (engine_ms > 0) {
        engine_total += g.per_step * engine_ms;
        best_total += g.per_step * best_ms;
      }
    }
  }
  std::printf(
      "\nGEMMs per step: %.2f ms with the engine's algorithms, %.2f ms with the fastest of each "
      "(saving %.2f ms)\n",
      engine_total, best_total, engine_total - best_total);
  std::printf(
      "(\"?\": the engine's algorithm was not among the heuristic's first %d; raise "
      "--algos)\n",
      algos);
  return 0;
}

}  // namespace
}  // namespace muster::kernels::fast

int main(int argc, char** argv) { return muster::kernels::fast::Main(argc, argv); }
