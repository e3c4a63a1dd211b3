// GEMMs of the fused engine through cuBLASLt, with the bias, GELU and
// GELU-gradient epilogues fused, plus the deterministic bias gradient.
//
// A Gemm owns one cuBLASLt handle and a 32 MiB workspace on the current
// device, works on one stream, and caches per shape the descriptors and
// the algorithm the heuristic picked, so a step's ~100 calls cost no
// heuristic queries after the first step. The same shape always gets the
// same algorithm, so results are bitwise repeatable.
//
// Thread-safety: none; one thread drives a Gemm.
#pragma once

#include <cublasLt.h>

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels/fast/fast.h"

namespace muster::kernels::fast {

class ColumnSumsBatch;  // below

// How the GEMMs compute: kFp32 exact fp32; kTf32 fp32 storage on the
// tensor cores in TF32; kBf16 bf16 operands with fp32 accumulation.
enum class GemmMath { kFp32, kTf32, kBf16 };

// One cuBLASLt call in column-major terms (cuBLAS's): D (m, n) =
// alpha * op(A) op(B) + beta * D, batched with element strides. A and B
// are of the Gemm's act type; D of `d_type` (act or fp32).
struct LtCall {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int lda = 0;
  long long stride_a = 0;
  const void* b = nullptr;
  int ldb = 0;
  long long stride_b = 0;
  void* d = nullptr;
  int ldd = 0;
  long long stride_d = 0;
  bool d_fp32 = false;  // D in fp32 whatever the act type
  int batch = 1;
  float alpha = 1.0f, beta = 0.0f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // act type, length m
  void* aux = nullptr;         // act type, (m, n) with leading dimension aux_ld
  int aux_ld = 0;
};

class Gemm {
 public:
  // Returns 0 and sets *out, or an error code (fast.h).
  static int Create(GemmMath math, void* stream, std::unique_ptr<Gemm>* out);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  ActType act() const { return math_ == GemmMath::kBf16 ? ActType::kBf16 : ActType::kF32; }
  void* stream() const { return stream_; }
  // Later calls enqueue on `stream` (plans and workspace are kept).
  void set_stream(void* stream) { stream_ = stream; }

  int Run(const LtCall& call);

  // ---- the layer's three GEMMs, row-major, as kernels/matmul.h ----
  // out (BT, OC) = inp (BT, C) @ weight (OC, C)^T + bias (OC, or nullptr).
  // With pre_gelu: pre_gelu (BT, OC) gets that, and out = GELU(pre_gelu)
  // (tanh form). Overwrites.
  int Forward(void* out, void* pre_gelu, const void* inp, const void* weight, const void* bias,
              int BT, int C, int OC);
  // dinp (BT, C) = alpha * dout (BT, OC) @ weight (OC, C), overwritten; with
  // pre_gelu (BT, C), times GELU'(pre_gelu) (the GELU before this layer).
  int BackwardInput(void* dinp, const void* dout, const void* weight, const void* pre_gelu, int BT,
                    int C, int OC, float alpha);
  // dweight (OC, C) fp32 += alpha * dout (BT, OC)^T @ inp (BT, C), or =
  // with kOverwrite (beta 0: cuBLASLt does not read dweight).
  int BackwardWeight(float* dweight, GradWrite write, const void* dout, const void* inp, int BT,
                     int C, int OC, float alpha);
  // BiasGradient (below) on this Gemm's stream.
  int BackwardBias(float* dbias, GradWrite write, const void* dout, int BT, int OC, float* scratch,
                   ColumnSumsBatch* defer = nullptr);
  static size_t BiasGradScratchFloats(int BT, int OC);

  // ---- for tools/bench_gemm: what else cuBLASLt offers for a call ----
  // Every call Run gets from now on is appended to *calls (nullptr stops).
  void RecordCalls(std::vector<LtCall>* calls) { record_ = calls; }
  struct AlgorithmTime {
    int index = 0;             // in the heuristic's order of this query
    bool same_as_run = false;  // the algorithm Run uses for this call
    float ms = -1;             // per call, median of the rounds; < 0: it failed to run
    float waves = 0;           // the heuristic's wavesCount
  };
  // Runs `call` with each of the first `max` algorithms cuBLASLt's
  // heuristic offers, asked with the operands' alignment as Run asks (16
  // bytes) or, with assume_256, at cuBLASLt's default of 256 bytes (the
  // call's pointers must then be 256-byte aligned), `rounds` times `iters`
  // calls each on this Gemm's stream, and times them with CUDA events.
  // The call's outputs are written over, or added into with its beta.
  int TimeAlgorithms(const LtCall& call, int max, bool assume_256, int rounds, int iters,
                     std::vector<AlgorithmTime>* out);

 private:
  struct Plan;  // descriptors and algorithm of one shape
  using Key = std::tuple<bool, bool, int, int, int, int, int, int, long long, long long, long long,
                         int, bool, bool, int, int>;
  Gemm(GemmMath math, void* stream);
  int PlanFor(const LtCall& call, Plan** plan);

  GemmMath math_;
  void* stream_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  std::vector<LtCall>* record_ = nullptr;
};

// dbias (OC) fp32 += sum over the BT rows of dout (BT, OC, act), in a
// fixed order (= with kOverwrite). scratch: Gemm::BiasGradScratchFloats(BT,
// OC) floats. Our
// own kernels, no cuBLASLt (so the CPU emulation of kernels/simt runs it
// too). With `defer`, the second pass (below) is added to that batch
// instead of launched, and scratch must stay untouched until the batch
// runs.
int BiasGradient(ActType act, float* dbias, GradWrite write, const void* dout, int BT, int OC,
                 float* scratch, void* stream, ColumnSumsBatch* defer = nullptr);

// The second pass of the deterministic column sums (bias and LayerNorm
// parameter gradients): out1[c] += sum over r in [0, rows) of
// partials[r * stride + c] for c in [0, split), out2[c - split] for c in
// [split, n) (= with kOverwrite). The order is fixed: eight interleaved
// slices of the rows, each summed in order, then the slices in order.
struct ColumnSumsJob {
  float* out1;
  float* out2;  // nullptr where split == n
  int split;
  const float* partials;
  int rows, n, stride;
  GradWrite write;
};
// Runs `count` (at most ColumnSumsBatch::kMaxJobs) jobs in one launch;
// each job's bits are those it would have alone.
int AddColumnSums(const ColumnSumsJob* jobs, int count, void* stream);

// Second passes gathered to run in one launch: a block's backward has six
// (four biases, two LayerNorms), each of which alone is a launch of a few
// microseconds over 3-12 blocks. Add runs the batch first when it is full.
// Flush launches what was added, in the order added.
class ColumnSumsBatch {
 public:
  static constexpr int kMaxJobs = 8;
  int Add(const ColumnSumsJob& job, void* stream);
  int Flush(void* stream);
  int size() const { return count_; }

 private:
  ColumnSumsJob jobs_[kMaxJobs];
  int count_ = 0;
};

}  // namespace muster::kernels::fast
