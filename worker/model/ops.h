// The device back end of GptModel: memory, copies and the GPT-2 ops of
// kernels/, behind one interface with a CPU and a CUDA implementation, so
// the model's forward and backward passes are written once.
//
// Every op has the signature and semantics of its kernels/*.h function
// (shapes, which outputs accumulate, aliasing rules); pointers are device
// pointers (host pointers on the CPU). Work is ordered: each call sees the
// results of the calls before it. Copies to the host return when the data
// is there.
//
// Errors: allocation returns a Status. A failed CUDA launch or copy is
// recorded (the first one wins) and reported by status(); later calls
// still run, so callers check status() once per step rather than per op.
//
// Thread-safety: none; one thread drives an Ops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/adamw.h"
#include "worker/model/model.h"

namespace muster::worker {

class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  virtual absl::Status status() const = 0;

  // ---- memory ----
  // `bytes` of zeroed device memory, aligned to 256 bytes; Free(nullptr)
  // is a no-op.
  virtual absl::StatusOr<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // `bytes` of uninitialised device memory for a buffer that lives briefly
  // (a sharding strategy's gathered parameters, a stage's gradient). On
  // CUDA it comes from the stream-ordered pool (cudaMallocAsync), so
  // FreeTransient takes effect after the work issued before it, without
  // waiting for that work, and freed memory is reused without a trip to
  // the driver (the pool keeps what is freed: its release threshold is
  // set to keep all). On the CPU, host memory from malloc (16-byte
  // aligned), kept when freed for the next request of the same size, up to
  // the most bytes once lent at the same time.
  virtual absl::StatusOr<void*> AllocTransient(size_t bytes) = 0;
  virtual void FreeTransient(void* ptr) = 0;
  virtual void ToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual void ToHost(void* host_dst, const void* device_src, size_t bytes) const = 0;
  virtual void Zero(void* device_dst, size_t bytes) = 0;

  // ---- ops (kernels/*.h) ----
  virtual void EncoderForward(float* out, const int* tokens, const float* wte, const float* wpe,
                              int B, int T, int C) = 0;
  virtual void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int* tokens,
                               int B, int T, int C) = 0;
  virtual void LayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                                const float* weight, const float* bias, size_t N, int C) = 0;
  virtual void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, size_t N, int C) = 0;
  virtual void MatmulForward(float* out, const float* inp, const float* weight, const float* bias,
                             size_t BT, int C, int OC) = 0;
  virtual void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, size_t BT, int C, int OC) = 0;
  virtual void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                                int NH) = 0;
  virtual void AttentionBackward(float* dqkv, float* dpreatt, const float* dout, const float* qkv,
                                 const float* att, int B, int T, int C, int NH) = 0;
  virtual void GeluForward(float* out, const float* inp, size_t n) = 0;
  virtual void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) = 0;
  virtual void ResidualForward(float* out, const float* inp1, const float* inp2, size_t n) = 0;
  virtual void CrossEntropyForward(float* losses, float* lse, const float* logits,
                                   const int* targets, size_t N, int V, int Vp) = 0;
  virtual void CrossEntropyBackward(float* dlogits, const float* logits, const float* lse,
                                    const int* targets, float dloss, size_t N, int V, int Vp) = 0;
  // AdamW over `runs` of the buffers params, m, v, grads (floats
  // [begin, begin + count) of each): hyper.weight_decay where the run has
  // decay, 0 elsewhere. params_bf16: nullptr, or a bf16 copy of params
  // (raw bits, same layout) that gets the updated parameters rounded to
  // nearest even (kernels/bf16.h). The CUDA back end keeps each distinct run
  // table it is given on the device, so a caller passes a fixed set of
  // tables (one per AdamW group) and each call is one launch.
  struct AdamWRun {
    size_t begin = 0;
    size_t count = 0;
    bool decay = false;
  };
  virtual void AdamWUpdate(float* params, float* m, float* v, const float* grads,
                           uint16_t* params_bf16, const std::vector<AdamWRun>& runs,
                           const kernels::AdamWHyper& hyper, int step) = 0;
  // out (n raw bf16 bits) = in rounded to nearest even, and back (exact):
  // a sharding strategy's bf16 copies of the parameters it gathers or
  // sends (kernels/bf16.h; the same bits on both back ends).
  virtual void CastToBf16(uint16_t* out, const float* in, size_t n) = 0;
  virtual void CastFromBf16(float* out, const uint16_t* in, size_t n) = 0;
  // Sum of x[i]^2 in double, returned to the host.
  virtual double SumOfSquares(const float* x, size_t n) = 0;
  virtual void Scale(float* x, size_t n, float scale) = 0;
};

std::unique_ptr<Ops> MakeCpuOps();

// OK when this build has CUDA and the machine a GPU; FAILED_PRECONDITION
// (saying which is missing) otherwise.
absl::Status CudaAvailable();
// The CUDA back end on the current device; FAILED_PRECONDITION as above.
absl::StatusOr<std::unique_ptr<Ops>> MakeCudaOps();

// The CUDA device a process with this LOCAL_RANK uses: local_rank modulo
// the visible devices (so several processes may share one GPU, as in the
// tests on a one-GPU machine), made current with cudaSetDevice before the
// model, cuBLAS or NCCL touch the GPU.
struct CudaDeviceChoice {
  int device = 0;
  int visible = 0;  // devices visible to this process
};
absl::StatusOr<CudaDeviceChoice> SelectCudaDevice(int local_rank);

// What the current CUDA device is, for MFU: its name, and its dense peak
// FLOP/s for `precision` from a table of known GPUs (0 when the GPU is not
// in the table or there is none).
struct CudaDeviceInfo {
  std::string name;
  double peak_flops = 0;
  size_t memory_total = 0;  // bytes
};
absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(Precision precision);
// Bytes of device memory in use on the current GPU, by every process
// (cudaMemGetInfo: total - free).
absl::StatusOr<size_t> CudaMemoryInUse();

// The back end for `device`.
absl::StatusOr<std::unique_ptr<Ops>> MakeOps(Device device);

}  // namespace muster::worker
