// The CUDA back end: cudaMalloc'd memory, the kernels' ...Cuda launchers
// on the default stream, and one cuBLAS handle. Compiled only under
// --config=cuda (worker/model/ops_nocuda.cc stands in otherwise).
#include <algorithm>
#include <cstdint>
#include <deque>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/attention.h"
#include "kernels/crossentropy.h"
#include "kernels/encoder.h"
#include "kernels/fast/adamw.h"
#include "kernels/gelu.h"
#include "kernels/grad_norm.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "kernels/residual.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

namespace k = ::muster::kernels;

class CudaOps final : public Ops {
 public:
  // `pool` is the device's stream-ordered pool, or null where the device
  // has none (transient buffers are then plain cudaMalloc'd ones).
  CudaOps(cublasHandle_t blas, cudaMemPool_t pool) : blas_(blas), pool_(pool) {}
  ~CudaOps() override {
    for (AdamWTable& table : adamw_tables_) cudaFree(table.chunks);
    cudaFree(norm_scratch_);
    cublasDestroy(blas_);
    // What the pool keeps (see MakeCudaOps) goes back to the driver, for a
    // later model in this process or another process on the GPU.
    if (pool_ != nullptr && cudaDeviceSynchronize() == cudaSuccess) cudaMemPoolTrimTo(pool_, 0);
  }

  Device device() const override { return Device::kCuda; }
  absl::Status status() const override { return status_; }

  absl::StatusOr<void*> Alloc(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t error = Malloc(&ptr, bytes == 0 ? 1 : bytes);
    if (error != cudaSuccess) return AllocFailed(bytes, "cudaMalloc", error);
    Check("cudaMemset", cudaMemset(ptr, 0, bytes));
    return ptr;
  }
  void Free(void* ptr) override { cudaFree(ptr); }
  absl::StatusOr<void*> AllocTransient(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t error =
        pool_ == nullptr
            ? Malloc(&ptr, bytes == 0 ? 1 : bytes)
            : cudaMallocAsync(&ptr, bytes == 0 ? 1 : bytes, static_cast<cudaStream_t>(kStream));
    if (error != cudaSuccess) {
      return AllocFailed(bytes, pool_ == nullptr ? "cudaMalloc" : "cudaMallocAsync", error);
    }
    return ptr;
  }
  void FreeTransient(void* ptr) override {
    if (ptr == nullptr) return;
    if (pool_ == nullptr) {
      Check("cudaFree", cudaFree(ptr));
    } else {
      Check("cudaFreeAsync", cudaFreeAsync(ptr, static_cast<cudaStream_t>(kStream)));
    }
  }
  void ToDevice(void* dst, const void* src, size_t bytes) override {
    Check("cudaMemcpy to device", cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void ToHost(void* dst, const void* src, size_t bytes) const override {
    Check("cudaMemcpy to host", cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  void Zero(void* dst, size_t bytes) override { Check("cudaMemset", cudaMemset(dst, 0, bytes)); }

  void EncoderForward(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                      int T, int C) override {
    Check("encoder forward", k::EncoderForwardCuda(out, tokens, wte, wpe, B, T, C, kStream));
  }
  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T,
                       int C) override {
    Check("encoder backward", k::EncoderBackwardCuda(dwte, dwpe, dout, tokens, B, T, C, kStream));
  }
  void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                        const float* bias, size_t N, int C) override {
    Check("layernorm forward",
          k::LayerNormForwardCuda(out, mean, rstd, inp, weight, bias, N, C, kStream));
  }
  void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, size_t N, int C) override {
    Check("layernorm backward", k::LayerNormBackwardCuda(dinp, dweight, dbias, dout, inp, weight,
                                                         mean, rstd, N, C, kStream));
  }
  void MatmulForward(float* out, const float* inp, const float* weight, const float* bias,
                     size_t BT, int C, int OC) override {
    Check("matmul forward",
          k::MatmulForwardCuda(out, inp, weight, bias, BT, C, OC, blas_, kStream));
  }
  void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                      const float* inp, const float* weight, size_t BT, int C, int OC) override {
    Check("matmul backward", k::MatmulBackwardCuda(dinp, dweight, dbias, dout, inp, weight, BT, C,
                                                   OC, blas_, kStream));
  }
  void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                        int NH) override {
    Check("attention forward", k::AttentionForwardCuda(out, att, qkv, B, T, C, NH, kStream));
  }
  void AttentionBackward(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                         const float* att, int B, int T, int C, int NH) override {
    Check("attention backward",
          k::AttentionBackwardCuda(dqkv, dpreatt, dout, qkv, att, B, T, C, NH, kStream));
  }
  void GeluForward(float* out, const float* inp, size_t n) override {
    Check("gelu forward", k::GeluForwardCuda(out, inp, n, kStream));
  }
  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    Check("gelu backward", k::GeluBackwardCuda(dinp, inp, dout, n, kStream));
  }
  void ResidualForward(float* out, const float* inp1, const float* inp2, size_t n) override {
    Check("residual forward", k::ResidualForwardCuda(out, inp1, inp2, n, kStream));
  }
  void CrossEntropyForward(float* losses, float* lse, const float* logits, const int* targets,
                           size_t N, int V, int Vp) override {
    Check("crossentropy forward",
          k::CrossEntropyForwardCuda(losses, lse, logits, targets, N, V, Vp, kStream));
  }
  void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse,
                            const int* targets, float dloss, size_t N, int V, int Vp) override {
    Check("crossentropy backward",
          k::CrossEntropyBackwardCuda(dlogits, logits, lse, targets, dloss, N, V, Vp, kStream));
  }
  void AdamWUpdate(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                   const std::vector<AdamWRun>& runs, const k::AdamWHyper& hyper,
                   int step) override {
    const AdamWTable* table = FindAdamWTable(runs);
    if (table == nullptr) table = UploadAdamWTable(runs);
    // No table (its upload failed: status() says why), or nothing to update
    // (an FSDP rank's empty slice of a stage smaller than the shard group).
    if (table == nullptr || table->chunk_count == 0) return;
    Check("adamw",
          k::fast::AdamWUpdateChunks(params, m, v, grads, params_bf16, table->chunks,
                                     table->chunk_count, table->aligned, hyper, step, kStream));
  }
  void CastToBf16(uint16_t* out, const float* in, size_t n) override {
    Check("bf16 cast", k::fast::CastToBf16(out, in, n, kStream));
  }
  void CastFromBf16(float* out, const uint16_t* in, size_t n) override {
    Check("bf16 widen", k::fast::CastFromBf16(out, in, n, kStream));
  }
  double SumOfSquares(const float* x, size_t n) override {
    // One device result double followed by the kernel's scratch, grown to
    // the largest buffer seen and then reused.
    const size_t doubles = 1 + k::SumOfSquaresCudaScratch(n);
    if (doubles > norm_scratch_doubles_) {
      cudaFree(norm_scratch_);
      norm_scratch_ = nullptr;
      norm_scratch_doubles_ = 0;
      if (!Check("cudaMalloc",
                 Malloc(reinterpret_cast<void**>(&norm_scratch_), doubles * sizeof(double)))) {
        return 0.0;
      }
      norm_scratch_doubles_ = doubles;
    }
    Check("sum of squares", k::SumOfSquaresCuda(norm_scratch_, norm_scratch_ + 1, x, n, kStream));
    double sum = 0.0;
    ToHost(&sum, norm_scratch_, sizeof(double));
    return sum;
  }
  void Scale(float* x, size_t n, float scale) override {
    Check("scale", k::ScaleCuda(x, n, scale, kStream));
  }

 private:
  static constexpr void* kStream = nullptr;  // the default stream orders all work

  // cudaMalloc, and once more after the pool has handed back what it keeps
  // when the first try finds too little memory: the pool's release
  // threshold (MakeCudaOps) keeps freed transient buffers from the driver,
  // and a plain cudaMalloc cannot take them.
  cudaError_t Malloc(void** ptr, size_t bytes) {
    cudaError_t error = cudaMalloc(ptr, bytes);
    if (error != cudaErrorMemoryAllocation || pool_ == nullptr) return error;
    cudaGetLastError();  // the allocation failure is not sticky: clear it
    // A kernel that faulted earlier shows here: that error, not out of
    // memory, is the one to report (AllocFailed makes it INTERNAL).
    if (const cudaError_t synced = cudaDeviceSynchronize(); synced != cudaSuccess) return synced;
    cudaMemPoolTrimTo(pool_, 0);
    return cudaMalloc(ptr, bytes);
  }

  // A failed allocation. Out of memory is not sticky: it is cleared and
  // reported as RESOURCE_EXHAUSTED with the bytes asked for and the bytes
  // free, and the model can go on or be replaced. Any other error (a kernel
  // that faulted earlier makes every later call fail) is the back end's
  // failure: INTERNAL, and recorded in status().
  absl::Status AllocFailed(size_t bytes, const char* call, cudaError_t error) {
    if (error != cudaErrorMemoryAllocation) {
      Check(call, error);
      return status_;
    }
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    uint64_t reserved = 0, used = 0;
    if (pool_ != nullptr) {
      cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved);
      cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used);
    }
    const uint64_t kept = reserved > used ? reserved - used : 0;
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of GPU memory: asked for ", bytes, " bytes (", absl::StrFormat("%.2f", bytes / 1e9),
        " GB) with ", free_bytes, " bytes (", absl::StrFormat("%.2f", free_bytes / 1e9),
        " GB) free of ", absl::StrFormat("%.2f", total_bytes / 1e9), " GB",
        kept > 0 ? absl::StrFormat(" and %.2f GB kept free in the memory pool", kept / 1e9) : "",
        " (", call, ": ", cudaGetErrorString(error), "); lower data.micro_batch or model.seq_len"));
  }

  // Records the first failure; `code` is a cudaError_t, or for matmuls
  // kCublasErrorBase + a cublasStatus_t.
  bool Check(const char* what, int code) const {
    if (code == 0) return true;
    if (status_.ok()) {
      std::string detail = code >= k::kCublasErrorBase
                               ? absl::StrCat("cuBLAS status ", code - k::kCublasErrorBase)
                               : cudaGetErrorString(static_cast<cudaError_t>(code));
      status_ = absl::InternalError(absl::StrCat("CUDA ", what, " failed: ", detail));
    }
    return false;
  }

  // A run table of AdamWUpdate, split into one chunk per block, on the
  // device. A model's AdamW groups never change their runs, so each table
  // is uploaded once and kept (FSDP steps one group per stage).
  struct AdamWTable {
    std::vector<AdamWRun> runs;
    k::fast::AdamWChunk* chunks = nullptr;
    int chunk_count = 0;
    bool aligned = true;  // every run starts on 16 bytes: 128-bit accesses
  };

  const AdamWTable* FindAdamWTable(const std::vector<AdamWRun>& runs) const {
    for (const AdamWTable& table : adamw_tables_) {
      if (std::equal(runs.begin(), runs.end(), table.runs.begin(), table.runs.end(),
                     [](const AdamWRun& a, const AdamWRun& b) {
                       return a.begin == b.begin && a.count == b.count && a.decay == b.decay;
                     })) {
        return &table;
      }
    }
    return nullptr;
  }

  const AdamWTable* UploadAdamWTable(const std::vector<AdamWRun>& runs) {
    AdamWTable table;
    table.runs = runs;
    std::vector<k::fast::AdamWChunk> chunks;
    for (const AdamWRun& run : runs) {
      chunks.push_back(k::fast::AdamWChunk{run.begin, run.count, run.decay ? 1u : 0u});
      table.aligned = table.aligned && run.begin % 4 == 0;
    }
    const std::vector<k::fast::AdamWChunk> pieces = k::fast::SplitAdamWRuns(chunks);
    const size_t bytes = pieces.size() * sizeof(k::fast::AdamWChunk);
    if (!pieces.empty()) {  // an empty table needs no device memory
      if (!Check("cudaMalloc", Malloc(reinterpret_cast<void**>(&table.chunks), bytes))) {
        return nullptr;
      }
      ToDevice(table.chunks, pieces.data(), bytes);
    }
    table.chunk_count = static_cast<int>(pieces.size());
    adamw_tables_.push_back(std::move(table));
    return &adamw_tables_.back();
  }

  cublasHandle_t blas_;
  cudaMemPool_t pool_;
  std::deque<AdamWTable> adamw_tables_;  // stable addresses
  double* norm_scratch_ = nullptr;
  size_t norm_scratch_doubles_ = 0;
  mutable absl::Status status_;
};

}  // namespace

absl::Status CudaAvailable() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: no usable GPU (cudaGetDeviceCount: ",
                     error != cudaSuccess ? cudaGetErrorString(error) : "0 devices", ")"));
  }
  return absl::OkStatus();
}

namespace {

// Dense (no sparsity) peak FLOP/s by GPU name, from NVIDIA's data sheets:
// bf16, tf32 and fp32 (non-tensor) rates. The first entry whose every
// name part the device name contains wins, so specific names come first.
struct PeakEntry {
  const char* parts[2];
  double bf16, tf32, fp32;
};
constexpr PeakEntry kPeaks[] = {
    {{"H100", "PCIe"}, 756e12, 378e12, 51.2e12}, {{"H100", "NVL"}, 835e12, 418e12, 60e12},
    {{"H100", ""}, 989.4e12, 494.7e12, 66.9e12},  // SXM ("H100 80GB HBM3")
    {{"H200", ""}, 989.4e12, 494.7e12, 66.9e12}, {{"A100", ""}, 312e12, 156e12, 19.5e12},
};

}  // namespace

absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(Precision precision) {
  if (absl::Status available = CudaAvailable(); !available.ok()) return available;
  int device = 0;
  cudaDeviceProp properties;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&properties, device) != cudaSuccess) {
    return absl::InternalError("cudaGetDeviceProperties failed");
  }
  CudaDeviceInfo info;
  info.name = properties.name;
  info.memory_total = properties.totalGlobalMem;
  for (const PeakEntry& entry : kPeaks) {
    if (!absl::StrContains(info.name, entry.parts[0]) ||
        !absl::StrContains(info.name, entry.parts[1])) {
      continue;
    }
    info.peak_flops = precision == Precision::kBf16   ? entry.bf16
                      : precision == Precision::kTf32 ? entry.tf32
                                                      : entry.fp32;
    break;
  }
  return info;
}

absl::StatusOr<CudaDeviceChoice> SelectCudaDevice(int local_rank) {
  if (absl::Status available = CudaAvailable(); !available.ok()) return available;
  if (local_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("LOCAL_RANK ", local_rank, " is negative"));
  }
  CudaDeviceChoice choice;
  cudaGetDeviceCount(&choice.visible);
  choice.device = local_rank % choice.visible;
  const cudaError_t error = cudaSetDevice(choice.device);
  if (error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaSetDevice(", choice.device, ") for LOCAL_RANK ",
                                            local_rank, ": ", cudaGetErrorString(error)));
  }
  return choice;
}

absl::StatusOr<size_t> CudaMemoryInUse() {
  if (absl::Status available = CudaAvailable(); !available.ok()) return available;
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t error = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(error)));
  }
  return total_bytes - free_bytes;
}

absl::StatusOr<std::unique_ptr<Ops>> MakeCudaOps() {
  if (absl::Status available = CudaAvailable(); !available.ok()) return available;
  cublasHandle_t blas = nullptr;
  const cublasStatus_t created = cublasCreate(&blas);
  if (created != CUBLAS_STATUS_SUCCESS) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: cublasCreate failed with status ", created));
  }
  // The stream-ordered pool AllocTransient draws on keeps what is freed
  // instead of handing it back to the driver at the next synchronize, which
  // is what its default release threshold (0) does: FSDP frees and retakes
  // the same stage buffers every step, and the worker synchronizes every
  // step. (The CPU keeps its transient buffers for the same reason,
  // ops_cpu.cc.) The pool is the current device's, the one
  // SelectCudaDevice set.
  // A device without stream-ordered pools (cudaDevAttrMemoryPoolsSupported
  // 0) gets plain cudaMalloc for transient buffers instead.
  int device = 0, pools_supported = 0;
  cudaMemPool_t pool = nullptr;
  uint64_t keep_all = UINT64_MAX;
  cudaError_t pooled = cudaGetDevice(&device);
  if (pooled == cudaSuccess) {
    pooled = cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, device);
  }
  if (pooled == cudaSuccess && pools_supported != 0) {
    pooled = cudaDeviceGetDefaultMemPool(&pool, device);
    if (pooled == cudaSuccess) {
      pooled = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    }
  }
  if (pooled != cudaSuccess) {
    cudaGetLastError();  // not left for the next kernel launch to report
    cublasDestroy(blas);
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: the stream-ordered memory pool: ", cudaGetErrorString(pooled)));
  }
  return std::unique_ptr<Ops>(new CudaOps(blas, pools_supported != 0 ? pool : nullptr));
}

}  // namespace muster::worker
