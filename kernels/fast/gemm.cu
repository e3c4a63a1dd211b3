// cuBLASLt calls with cached plans, and the two-pass deterministic column
// sums of the bias gradient.
#include <algorithm>
#include <cassert>
#include <cstring>
#include <vector>

#include "kernels/fast/common.cuh"
#include "kernels/fast/gemm.h"
#include "kernels/gelu.h"
#include "kernels/matmul.h"

namespace muster::kernels::fast {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLAS suggests for Hopper

int LtStatus(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? 0 : kCublasErrorBase + static_cast<int>(status);
}

// ---- bias gradient: column sums of dout (BT, OC) ----
// Pass 1: block (x, y) sums rows [y * kBiasRows, ...) of the columns
// [x * 32 * P, ...) where P = Pack<T>::kSize: each warp takes every 8th
// row of the chunk, each lane P columns, so each row is read with 128-bit
// loads; then the 8 warps' sums are added in warp order.
constexpr int kBiasWarps = 8;
constexpr int kBiasRows = 64;  // 128 chunks of GPT-2's 8192 rows: enough blocks to fill the GPU

template <typename T>
__global__ void BiasPartialsKernel(float* partials, const T* dout, int BT, int OC) {
  constexpr int P = Pack<T>::kSize;
  __shared__ float sums[kBiasWarps][32 * P];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = (blockIdx.x * 32 + lane) * P;
  const int row_begin = blockIdx.y * kBiasRows;
  const int row_end = min(row_begin + kBiasRows, BT);
  float acc[P];
  for (int i = 0; i < P; ++i) acc[i] = 0.0f;
  if (col < OC) {
    for (int row = row_begin + warp; row < row_end; row += kBiasWarps) {
      const Pack<T> x = LoadPack(dout + static_cast<size_t>(row) * OC + col);
      for (int i = 0; i < P; ++i) acc[i] += ToFloat(x.v[i]);
    }
  }
  for (int i = 0; i < P; ++i) sums[warp][lane * P + i] = acc[i];
  __syncthreads();
  for (int j = threadIdx.x; j < 32 * P; j += blockDim.x) {
    float total = 0.0f;
    for (int w = 0; w < kBiasWarps; ++w) total += sums[w][j];
    const int c = blockIdx.x * 32 * P + j;
    if (c < OC) partials[static_cast<size_t>(blockIdx.y) * OC + c] = total;
  }
}

// Pass 2 (AddColumnSums): column c of `partials` (rows, stride) is added
// into out1[c] for c < split, out2[c - split] after. A block is 32 columns
// (a lane each, so each row's part is one 128-byte read) by kSumSlices
// warps: warp s sums rows s, s + kSumSlices, ..., and warp 0 adds the
// slices in order. The order is fixed, so the bits are the same every
// run. (A thread per column over every row, the first version, made 3-12
// blocks at GPT-2's widths, each thread waiting on 128-256 loads in turn.)
// One launch runs every job of a ColumnSumsBatch: the jobs' blocks follow
// one another, and a block finds its job in the table it was passed by
// value. A job's block sums as it would in a launch of its own, so the
// bits do not depend on what else shares the launch.
constexpr int kSumSlices = 8;

struct ColumnSumsLaunch {
  ColumnSumsJob job[ColumnSumsBatch::kMaxJobs];
  // Job j's blocks: [first_block[j], first_block[j + 1]).
  int first_block[ColumnSumsBatch::kMaxJobs + 1];
  int count;  // jobs with columns to sum
};

__global__ void AddColumnSumsKernel(const ColumnSumsLaunch launch) {
  __shared__ float sums[kSumSlices][32];
  int j = 0;
  while (j + 1 < launch.count && static_cast<int>(blockIdx.x) >= launch.first_block[j + 1]) ++j;
  const ColumnSumsJob& job = launch.job[j];
  const int lane = threadIdx.x % 32, slice = threadIdx.x / 32;
  const int c = (static_cast<int>(blockIdx.x) - launch.first_block[j]) * 32 + lane;
  float total = 0.0f;
  if (c < job.n) {
#pragma unroll 4
    for (int r = slice; r < job.rows; r += kSumSlices) {
      total += job.partials[static_cast<size_t>(r) * job.stride + c];
    }
  }
  sums[slice][lane] = total;
  __syncthreads();
  if (slice != 0 || c >= job.n) return;
  float sum = 0.0f;
  for (int s = 0; s < kSumSlices; ++s) sum += sums[s][lane];
  float& out = c < job.split ? job.out1[c] : job.out2[c - job.split];
  out = job.write == GradWrite::kOverwrite ? sum : out + sum;
}

// The GELU epilogues' stand-ins, for a GPU or type whose cuBLASLt has no
// algorithm with them: the same tanh-form math as the CPU (gelu.h).
template <typename T>
__global__ void GeluForwardKernel(T* out, const T* pre_gelu, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = FromFloat<T>(GeluForwardElem(ToFloat(pre_gelu[i])));
}

template <typename T>
__global__ void GeluBackwardKernel(T* dinp, const T* pre_gelu, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) dinp[i] = FromFloat<T>(GeluBackwardElem(ToFloat(pre_gelu[i]), ToFloat(dinp[i])));
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm(GemmMath math, void* stream) : math_(math), stream_(stream) {}

int Gemm::Create(GemmMath math, void* stream, std::unique_ptr<Gemm>* out) {
  std::unique_ptr<Gemm> gemm(new Gemm(math, stream));
  int status = LtStatus(cublasLtCreate(&gemm->handle_));
  if (status != 0) return status;
  status = static_cast<int>(cudaMalloc(&gemm->workspace_, kWorkspaceBytes));
  if (status != 0) return status;
  *out = std::move(gemm);
  return 0;
}

Gemm::~Gemm() {
  plans_.clear();
  cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

namespace {

int MakeLayout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int rows, int cols, int ld,
               int batch, long long stride) {
  int status = LtStatus(cublasLtMatrixLayoutCreate(layout, type, rows, cols, ld));
  if (status != 0 || batch == 1) return status;
  status = LtStatus(cublasLtMatrixLayoutSetAttribute(*layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &batch, sizeof(batch)));
  if (status != 0) return status;
  int64_t offset = stride;
  return LtStatus(cublasLtMatrixLayoutSetAttribute(
      *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof(offset)));
}

// The call's bias and aux pointers on `desc` (they change per call; the
// rest of a plan does not).
int SetEpiloguePointers(cublasLtMatmulDesc_t desc, const LtCall& c) {
  int status = 0;
  if (c.bias != nullptr) {
    status = LtStatus(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &c.bias, sizeof(c.bias)));
  }
  if (status == 0 && c.aux != nullptr) {
    status = LtStatus(cublasLtMatmulDescSetAttribute(
        desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &c.aux, sizeof(c.aux)));
  }
  return status;
}

// The heuristic's first `max` algorithms for a matmul whose operands are
// aligned to `alignment` bytes, in its order (at least one, or
// kNoGemmAlgorithm).
int Heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, uint32_t alignment, int max,
              std::vector<cublasLtMatmulHeuristicResult_t>* out) {
  cublasLtMatmulPreference_t preference = nullptr;
  int status = LtStatus(cublasLtMatmulPreferenceCreate(&preference));
  if (status != 0) return status;
  const uint64_t workspace = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace, sizeof(workspace));
  for (auto attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    cublasLtMatmulPreferenceSetAttribute(preference, attribute, &alignment, sizeof(alignment));
  }
  out->resize(max);
  int returned = 0;
  status = LtStatus(cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, preference, max,
                                                   out->data(), &returned));
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != 0) return status;
  if (returned == 0) return kNoGemmAlgorithm;
  out->resize(returned);
  return 0;
}

}  // namespace

int Gemm::PlanFor(const LtCall& c, Plan** out) {
  const Key key{c.trans_a,
                c.trans_b,
                c.m,
                c.n,
                c.k,
                c.lda,
                c.ldb,
                c.ldd,
                c.stride_a,
                c.stride_b,
                c.stride_d,
                c.batch,
                c.d_fp32,
                c.beta != 0.0f,
                static_cast<int>(c.epilogue),
                c.aux_ld};
  auto found = plans_.find(key);
  if (found != plans_.end()) {
    *out = found->second.get();
    return 0;
  }
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t ab_type = math_ == GemmMath::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t d_type = c.d_fp32 ? CUDA_R_32F : ab_type;
  const cublasComputeType_t compute =
      math_ == GemmMath::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  int status = LtStatus(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F));
  if (status != 0) return status;
  const cublasOperation_t op_a = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  status = LtStatus(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  if (status == 0) {
    status = LtStatus(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                                     sizeof(op_b)));
  }
  if (status == 0 && c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    status = LtStatus(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &c.epilogue, sizeof(c.epilogue)));
  }
  if (status == 0 && c.aux != nullptr) {
    const int64_t aux_ld = c.aux_ld;
    status = LtStatus(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  if (status != 0) return status;
  // The stored (pre-op) shapes: op(A) is (m, k), op(B) is (k, n).
  status = MakeLayout(&plan->a, ab_type, c.trans_a ? c.k : c.m, c.trans_a ? c.m : c.k, c.lda,
                      c.batch, c.stride_a);
  if (status == 0) {
    status = MakeLayout(&plan->b, ab_type, c.trans_b ? c.n : c.k, c.trans_b ? c.k : c.n, c.ldb,
                        c.batch, c.stride_b);
  }
  if (status == 0) status = MakeLayout(&plan->d, d_type, c.m, c.n, c.ldd, c.batch, c.stride_d);
  if (status != 0) return status;

  // The bias/aux pointers must be set before the heuristic query, as they
  // change which kernels apply.
  status = SetEpiloguePointers(plan->desc, c);
  if (status != 0) return status;

  // Our operands start on 16-byte boundaries (fast.h), not the 256 the
  // heuristic assumes by default: ask only for algorithms that allow that.
  std::vector<cublasLtMatmulHeuristicResult_t> heuristic;
  status = Heuristic(handle_, plan->desc, plan->a, plan->b, plan->d, 16, 1, &heuristic);
  if (status != 0) return status;
  plan->algo = heuristic[0].algo;
  *out = plan.get();
  plans_.emplace(key, std::move(plan));
  return 0;
}

int Gemm::Run(const LtCall& c) {
  if (record_ != nullptr) record_->push_back(c);
  if (c.m == 0 || c.n == 0) return 0;
  Plan* plan = nullptr;
  int status = PlanFor(c, &plan);
  if (status != 0) return status;
  status = SetEpiloguePointers(plan->desc, c);
  if (status != 0) return status;
  return LtStatus(cublasLtMatmul(handle_, plan->desc, &c.alpha, c.a, plan->a, c.b, plan->b, &c.beta,
                                 c.d, plan->d, c.d, plan->d, &plan->algo, workspace_,
                                 kWorkspaceBytes, AsStream(stream_)));
}

int Gemm::Forward(void* out, void* pre_gelu, const void* inp, const void* weight, const void* bias,
                  int BT, int C, int OC) {
  // out^T (OC, BT) = weight (stored (C, OC), transposed) @ inp^T (C, BT).
  LtCall call;
  call.trans_a = true;
  call.m = OC;
  call.n = BT;
  call.k = C;
  call.a = weight;
  call.lda = C;
  call.b = inp;
  call.ldb = C;
  call.d = out;
  call.ldd = OC;
  call.bias = bias;
  if (pre_gelu != nullptr) {
    call.epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    call.aux = pre_gelu;
    call.aux_ld = OC;
  } else if (bias != nullptr) {
    call.epilogue = CUBLASLT_EPILOGUE_BIAS;
  }
  int status = Run(call);
  if (status != kNoGemmAlgorithm || pre_gelu == nullptr) return status;
  // No fused GELU here: the GEMM writes pre_gelu, a kernel the GELU.
  call.epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  call.aux = nullptr;
  call.aux_ld = 0;
  call.d = pre_gelu;
  status = Run(call);
  if (status != 0) return status;
  const size_t n = static_cast<size_t>(BT) * OC;
  return Dispatch(act(), [&](auto tag) {
    using T = decltype(tag);
    LaunchKernel<GeluForwardKernel<T>>(CeilDiv(n, 256), 256, 0, AsStream(stream_),
                                       static_cast<T*>(out), static_cast<const T*>(pre_gelu), n);
    return LaunchStatus();
  });
}

int Gemm::BackwardInput(void* dinp, const void* dout, const void* weight, const void* pre_gelu,
                        int BT, int C, int OC, float alpha) {
  // dinp^T (C, BT) = weight^T (stored (C, OC)) @ dout^T (OC, BT).
  LtCall call;
  call.m = C;
  call.n = BT;
  call.k = OC;
  call.a = weight;
  call.lda = C;
  call.b = dout;
  call.ldb = OC;
  call.d = dinp;
  call.ldd = C;
  call.alpha = alpha;
  if (pre_gelu != nullptr) {
    call.epilogue = CUBLASLT_EPILOGUE_DGELU;
    call.aux = const_cast<void*>(pre_gelu);  // read, not written, by DGELU
    call.aux_ld = C;
  }
  int status = Run(call);
  if (status != kNoGemmAlgorithm || pre_gelu == nullptr) return status;
  // No fused GELU gradient here: a kernel applies it after the GEMM.
  call.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  call.aux = nullptr;
  call.aux_ld = 0;
  status = Run(call);
  if (status != 0) return status;
  const size_t n = static_cast<size_t>(BT) * C;
  return Dispatch(act(), [&](auto tag) {
    using T = decltype(tag);
    LaunchKernel<GeluBackwardKernel<T>>(CeilDiv(n, 256), 256, 0, AsStream(stream_),
                                        static_cast<T*>(dinp), static_cast<const T*>(pre_gelu), n);
    return LaunchStatus();
  });
}

int Gemm::BackwardWeight(float* dweight, GradWrite write, const void* dout, const void* inp, int BT,
                         int C, int OC, float alpha) {
  // dweight^T (C, OC) += inp^T (C, BT) @ dout (stored (OC, BT), transposed).
  LtCall call;
  call.trans_b = true;
  call.m = C;
  call.n = OC;
  call.k = BT;
  call.a = inp;
  call.lda = C;
  call.b = dout;
  call.ldb = OC;
  call.d = dweight;
  call.ldd = C;
  call.d_fp32 = true;
  call.alpha = alpha;
  // The plan's key holds beta != 0, but cuBLASLt's heuristic is not told
  // beta, so both get the same algorithm: the same products, the same bits.
  call.beta = write == GradWrite::kAdd ? 1.0f : 0.0f;
  return Run(call);
}

size_t Gemm::BiasGradScratchFloats(int BT, int OC) {
  return static_cast<size_t>(CeilDiv(BT, kBiasRows)) * OC;
}

int Gemm::BackwardBias(float* dbias, GradWrite write, const void* dout, int BT, int OC,
                       float* scratch, ColumnSumsBatch* defer) {
  return BiasGradient(act(), dbias, write, dout, BT, OC, scratch, stream_, defer);
}

int BiasGradient(ActType act, float* dbias, GradWrite write, const void* dout, int BT, int OC,
                 float* scratch, void* stream, ColumnSumsBatch* defer) {
  if (BT == 0 || OC == 0) return 0;
  const unsigned chunks = CeilDiv(BT, kBiasRows);
  int status = Dispatch(act, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(CeilDiv(OC, 32 * Pack<T>::kSize), chunks);
    LaunchKernel<BiasPartialsKernel<T>>(grid, 32 * kBiasWarps, 0, AsStream(stream), scratch,
                                        static_cast<const T*>(dout), BT, OC);
    return LaunchStatus();
  });
  if (status != 0) return status;
  const ColumnSumsJob job{dbias, nullptr, OC, scratch, static_cast<int>(chunks), OC, OC, write};
  return defer != nullptr ? defer->Add(job, stream) : AddColumnSums(&job, 1, stream);
}

int ColumnSumsBatch::Add(const ColumnSumsJob& job, void* stream) {
  if (count_ == kMaxJobs) {
    const int status = Flush(stream);
    if (status != 0) return status;
  }
  jobs_[count_++] = job;
  return 0;
}

int ColumnSumsBatch::Flush(void* stream) {
  const int status = AddColumnSums(jobs_, count_, stream);
  count_ = 0;
  return status;
}

int AddColumnSums(const ColumnSumsJob* jobs, int count, void* stream) {
  assert(count <= ColumnSumsBatch::kMaxJobs);
  ColumnSumsLaunch launch{};
  int blocks = 0;
  for (int i = 0; i < count; ++i) {
    if (jobs[i].n <= 0) continue;
    launch.job[launch.count] = jobs[i];
    launch.first_block[launch.count++] = blocks;
    blocks += CeilDiv(jobs[i].n, 32);
  }
  if (blocks == 0) return 0;
  launch.first_block[launch.count] = blocks;
  LaunchKernel<AddColumnSumsKernel>(blocks, 32 * kSumSlices, 0, AsStream(stream), launch);
  return LaunchStatus();
}

int Gemm::TimeAlgorithms(const LtCall& c, int max, bool assume_256, int rounds, int iters,
                         std::vector<AlgorithmTime>* out) {
  out->clear();
  if (c.m == 0 || c.n == 0 || max < 1 || rounds < 1 || iters < 1) return cudaErrorInvalidValue;
  Plan* plan = nullptr;
  int status = PlanFor(c, &plan);
  if (status == 0) status = SetEpiloguePointers(plan->desc, c);
  if (status != 0) return status;
  std::vector<cublasLtMatmulHeuristicResult_t> heuristic;
  status = Heuristic(handle_, plan->desc, plan->a, plan->b, plan->d, assume_256 ? 256 : 16, max,
                     &heuristic);
  if (status != 0) return status;
  cudaEvent_t start = nullptr, stop = nullptr;
  status = static_cast<int>(cudaEventCreate(&start));
  if (status == 0) status = static_cast<int>(cudaEventCreate(&stop));
  const cudaStream_t stream = AsStream(stream_);
  for (size_t i = 0; status == 0 && i < heuristic.size(); ++i) {
    AlgorithmTime time;
    time.index = static_cast<int>(i);
    time.same_as_run = std::memcmp(&heuristic[i].algo, &plan->algo, sizeof(plan->algo)) == 0;
    time.waves = heuristic[i].wavesCount;
    auto call = [&] {
      return LtStatus(cublasLtMatmul(handle_, plan->desc, &c.alpha, c.a, plan->a, c.b, plan->b,
                                     &c.beta, c.d, plan->d, c.d, plan->d, &heuristic[i].algo,
                                     workspace_, kWorkspaceBytes, stream));
    };
    // One untimed call: an algorithm that cannot run this call says so here.
    if (call() != 0 || cudaStreamSynchronize(stream) != cudaSuccess) {
      cudaGetLastError();
      out->push_back(time);
      continue;
    }
    std::vector<float> per_call;
    for (int r = 0; r < rounds && status == 0; ++r) {
      cudaEventRecord(start, stream);
      for (int it = 0; it < iters && status == 0; ++it) status = call();
      cudaEventRecord(stop, stream);
      if (status == 0) status = static_cast<int>(cudaEventSynchronize(stop));
      float ms = 0;
      if (status == 0) status = static_cast<int>(cudaEventElapsedTime(&ms, start, stop));
      per_call.push_back(ms / iters);
    }
    if (status != 0) break;
    std::sort(per_call.begin(), per_call.end());
    time.ms = per_call[per_call.size() / 2];
    out->push_back(time);
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  return status;
}

}  // namespace muster::kernels::fast
