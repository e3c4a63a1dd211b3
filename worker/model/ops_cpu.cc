// The CPU back end: host memory and the kernels' ...Cpu loops.
#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/crossentropy.h"
#include "kernels/encoder.h"
#include "kernels/gelu.h"
#include "kernels/grad_norm.h"
#include "kernels/layernorm.h"
#include "kernels/matmul.h"
#include "kernels/residual.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

namespace k = ::muster::kernels;

constexpr size_t kAlignment = 256;
constexpr size_t kHugePage = size_t{2} << 20;  // x86-64's transparent huge page

class CpuOps final : public Ops {
 public:
  ~CpuOps() override {
    ReleaseKept();
    // Buffers still lent out belong to their holders, which free them
    // before the Ops (a shared_ptr they hold) goes.
  }

  // What the kernel says a new allocation could have without swapping
  // (MemAvailable in /proc/meminfo), in bytes; 0 when it cannot be read.
  static uint64_t AvailableHostBytes() {
    std::ifstream meminfo("/proc/meminfo");
    for (std::string line; std::getline(meminfo, line);) {
      uint64_t kib = 0;
      if (std::sscanf(line.c_str(), "MemAvailable: %" SCNu64 " kB", &kib) == 1) return kib << 10;
    }
    return 0;
  }

  // As the CUDA back end says it: the bytes asked for and the bytes free.
  static absl::Status OutOfMemory(size_t bytes) {
    const uint64_t available = AvailableHostBytes();
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of host memory: asked for ", bytes, " bytes (", absl::StrFormat("%.2f", bytes / 1e9),
        " GB)",
        available > 0
            ? absl::StrFormat(" with %u bytes (%.2f GB) available", available, available / 1e9)
            : "",
        "; lower data.micro_batch or model.seq_len, or the model's size"));
  }

  Device device() const override { return Device::kCpu; }
  absl::Status status() const override { return absl::OkStatus(); }

  // Blocks of kHugePage or more (parameters, gradients, moments, the
  // activations) are mappings of their own, aligned to a huge page and
  // advised to use huge pages (transparent huge pages in "madvise" mode,
  // the common default): one page fault per 2 MB instead of 512, and the
  // kernel's pages come zeroed. Faults are costly in a virtual machine: on
  // the development VM, zeroing a fresh model's malloc'd buffers, almost
  // all of it page faults, took a third of a 1-step run of a small GPT.
  // Not aligned_alloc + madvise: glibc may carve such a block from its
  // heap, and the advice then spreads to the heap grown after it, where
  // every small allocation touched a 2 MB page (peak RSS of GPT-2 124M
  // under DDP rose by 170 MB).
  absl::StatusOr<void*> Alloc(size_t bytes) override {
    if (bytes >= kHugePage) return MapHuge(bytes);
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (ptr == nullptr) return OutOfMemory(bytes);
    std::memset(ptr, 0, rounded);
    return ptr;
  }
  void Free(void* ptr) override {
    {
      absl::MutexLock lock(&huge_mu_);
      auto it = huge_.find(ptr);
      if (it != huge_.end()) {
        munmap(ptr, it->second);
        huge_.erase(it);
        return;
      }
    }
    std::free(ptr);
  }
  // Transient buffers are malloc'd (16-byte alignment is all the CPU
  // kernels need; aligned_alloc measured slower here) and, when freed, kept
  // for the next request of the same size. Why not free(): glibc hands a
  // freed multi-MB block back to the kernel (munmap, or by trimming the
  // heap's top), so FSDP's gathered parameters and gradients, taken and
  // freed per stage and step, were faulted in afresh every time, by the
  // training thread and, inside recv(), by Gloo's thread. The worker under
  // launch, 2 ranks on 2 cores, GPT L=4 C=256 T=128 B=8: ZeRO-3 ran at
  // 0.62-0.67x DDP's speed, its communication threads burning 4x DDP's CPU,
  // most of it page faults; 0.97-1.02x with this (docs/benchmarks.md).
  // Bytes lent plus bytes kept never exceed the most once lent together: a
  // new buffer first evicts kept ones of other sizes. So the cache adds no
  // buffer to the transient peak (measured: 57-78 MB more peak RSS for
  // GPT-2 124M under ZeRO-3, glibc's slack). A general-purpose caching
  // allocator would do this and more; none is in the stack.
  absl::StatusOr<void*> AllocTransient(size_t bytes) override {
    bytes = bytes == 0 ? 1 : bytes;
    std::vector<void*> evicted;
    {
      absl::MutexLock lock(&transient_mu_);
      auto kept = kept_.find(bytes);
      if (kept != kept_.end()) {
        void* ptr = kept->second;
        kept_.erase(kept);
        kept_bytes_ -= bytes;
        Lend(ptr, bytes);
        return ptr;
      }
      // A new buffer: first give back kept ones of other sizes until what
      // is lent and kept fits in the peak lent so far (or nothing is kept).
      const size_t need = lent_bytes_ + bytes;
      const size_t room = std::max(peak_lent_bytes_, need);
      for (auto it = kept_.begin(); it != kept_.end() && need + kept_bytes_ > room;) {
        kept_bytes_ -= it->first;
        evicted.push_back(it->second);
        it = kept_.erase(it);
      }
    }
    for (void* ptr : evicted) std::free(ptr);
    void* ptr = std::malloc(bytes);
    if (ptr == nullptr) {
      ReleaseKept();  // other sizes' buffers, then try again
      ptr = std::malloc(bytes);
      if (ptr == nullptr) return OutOfMemory(bytes);
    }
    absl::MutexLock lock(&transient_mu_);
    Lend(ptr, bytes);
    return ptr;
  }
  // Freed buffers are always kept: AllocTransient keeps lent + kept within
  // the peak lent, and a free moves bytes from one to the other.
  void FreeTransient(void* ptr) override {
    if (ptr == nullptr) return;
    absl::MutexLock lock(&transient_mu_);
    auto lent = lent_.find(ptr);
    assert(lent != lent_.end());
    const size_t bytes = lent->second;
    lent_.erase(lent);
    lent_bytes_ -= bytes;
    kept_.emplace(bytes, ptr);
    kept_bytes_ += bytes;
  }
  void ToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void ToHost(void* dst, const void* src, size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void Zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }

  void EncoderForward(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                      int T, int C) override {
    k::EncoderForwardCpu(out, tokens, wte, wpe, B, T, C);
  }
  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T,
                       int C) override {
    k::EncoderBackwardCpu(dwte, dwpe, dout, tokens, B, T, C);
  }
  void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                        const float* bias, size_t N, int C) override {
    k::LayerNormForwardCpu(out, mean, rstd, inp, weight, bias, N, C);
  }
  void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, size_t N, int C) override {
    k::LayerNormBackwardCpu(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void MatmulForward(float* out, const float* inp, const float* weight, const float* bias,
                     size_t BT, int C, int OC) override {
    k::MatmulForwardCpu(out, inp, weight, bias, BT, C, OC);
  }
  void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                      const float* inp, const float* weight, size_t BT, int C, int OC) override {
    k::MatmulBackwardCpu(dinp, dweight, dbias, dout, inp, weight, BT, C, OC);
  }
  void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                        int NH) override {
    k::AttentionForwardCpu(out, att, qkv, B, T, C, NH);
  }
  void AttentionBackward(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                         const float* att, int B, int T, int C, int NH) override {
    k::AttentionBackwardCpu(dqkv, dpreatt, dout, qkv, att, B, T, C, NH);
  }
  void GeluForward(float* out, const float* inp, size_t n) override {
    k::GeluForwardCpu(out, inp, n);
  }
  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    k::GeluBackwardCpu(dinp, inp, dout, n);
  }
  void ResidualForward(float* out, const float* inp1, const float* inp2, size_t n) override {
    k::ResidualForwardCpu(out, inp1, inp2, n);
  }
  void CrossEntropyForward(float* losses, float* lse, const float* logits, const int* targets,
                           size_t N, int V, int Vp) override {
    k::CrossEntropyForwardCpu(losses, lse, logits, targets, N, V, Vp);
  }
  void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse,
                            const int* targets, float dloss, size_t N, int V, int Vp) override {
    k::CrossEntropyBackwardCpu(dlogits, logits, lse, targets, dloss, N, V, Vp);
  }
  void AdamWUpdate(float* params, float* m, float* v, const float* grads, uint16_t* params_bf16,
                   const std::vector<AdamWRun>& runs, const k::AdamWHyper& hyper,
                   int step) override {
    for (const AdamWRun& run : runs) {
      k::AdamWHyper run_hyper = hyper;
      if (!run.decay) run_hyper.weight_decay = 0.0f;
      k::AdamWUpdateCpu(params + run.begin, m + run.begin, v + run.begin, grads + run.begin,
                        run.count, run_hyper, step);
      // A second pass over the run, still in cache: the CPU computes in
      // fp32, and only FSDP's bf16 all-gather asks for the copy.
      if (params_bf16 != nullptr) {
        CastToBf16(params_bf16 + run.begin, params + run.begin, run.count);
      }
    }
  }
  void CastToBf16(uint16_t* out, const float* in, size_t n) override {
    for (size_t i = 0; i < n; ++i) out[i] = k::Bf16FromFloat(in[i]);
  }
  void CastFromBf16(float* out, const uint16_t* in, size_t n) override {
    for (size_t i = 0; i < n; ++i) out[i] = k::FloatFromBf16(in[i]);
  }
  double SumOfSquares(const float* x, size_t n) override { return k::SumOfSquaresCpu(x, n); }
  void Scale(float* x, size_t n, float scale) override { k::ScaleCpu(x, n, scale); }

 private:
  // A zeroed, huge-page-aligned mapping of `bytes` rounded up to whole huge
  // pages; Free unmaps it.
  absl::StatusOr<void*> MapHuge(size_t bytes) {
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    // Map one huge page more, then unmap the slack on either side of the
    // aligned part.
    void* mapped = mmap(nullptr, rounded + kHugePage, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return OutOfMemory(bytes);
    const uintptr_t start = reinterpret_cast<uintptr_t>(mapped);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > start) munmap(mapped, aligned - start);
    const size_t tail = start + rounded + kHugePage - (aligned + rounded);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + rounded), tail);
    void* ptr = reinterpret_cast<void*>(aligned);
    // Advice only: without THP support it fails and changes nothing.
    (void)madvise(ptr, rounded, MADV_HUGEPAGE);
    absl::MutexLock lock(&huge_mu_);
    huge_[ptr] = rounded;
    return ptr;
  }

  absl::Mutex huge_mu_;
  std::unordered_map<void*, size_t> huge_ ABSL_GUARDED_BY(huge_mu_);  // MapHuge's blocks

  void Lend(void* ptr, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transient_mu_) {
    lent_.emplace(ptr, bytes);
    lent_bytes_ += bytes;
    peak_lent_bytes_ = std::max(peak_lent_bytes_, lent_bytes_);
  }
  void ReleaseKept() {
    std::unordered_multimap<size_t, void*> kept;
    {
      absl::MutexLock lock(&transient_mu_);
      kept.swap(kept_);
      kept_bytes_ = 0;
    }
    for (auto& [bytes, ptr] : kept) std::free(ptr);
  }

  absl::Mutex transient_mu_;
  std::unordered_map<void*, size_t> lent_ ABSL_GUARDED_BY(transient_mu_);       // buffer -> bytes
  std::unordered_multimap<size_t, void*> kept_ ABSL_GUARDED_BY(transient_mu_);  // bytes -> freed
  size_t lent_bytes_ ABSL_GUARDED_BY(transient_mu_) = 0;
  size_t kept_bytes_ ABSL_GUARDED_BY(transient_mu_) = 0;
  size_t peak_lent_bytes_ ABSL_GUARDED_BY(transient_mu_) = 0;
};

}  // namespace

std::unique_ptr<Ops> MakeCpuOps() { return std::make_unique<CpuOps>(); }

absl::StatusOr<std::unique_ptr<Ops>> MakeOps(Device device) {
  if (device == Device::kCuda) return MakeCudaOps();
  return MakeCpuOps();
}

}  // namespace muster::worker
