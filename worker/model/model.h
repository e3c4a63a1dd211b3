// GPT-2, as llm.c lays it out, with the memory layout the parallel
// strategies need (docs/architecture.md, "Worker"):
//
//   stage 0        "embedding"  wte (Vp, C), wpe (maxT, C)
//   stage 1..L     "block<i>"   ln1w ln1b (C), qkvw (3C, C) qkvb (3C),
//                               attprojw (C, C) attprojb (C), ln2w ln2b (C),
//                               fcw (4C, C) fcb (4C), fcprojw (C, 4C) fcprojb (C)
//   stage L+1      "head"       lnfw lnfb (C); the LM head is wte (tied)
//
// Each stage owns ONE contiguous fp32 parameter buffer and one gradient
// buffer of the same layout; tensors are named views into them. DDP buckets
// are slices of these buffers; FSDP (worker/strategy/fsdp/fsdp.h) shards them, and
// pipeline parallelism (worker/strategy/pipeline/pipeline.h) assigns whole stages to ranks.
//
// B batch, T time (<= maxT), C channels, NH heads, V vocab, Vp V padded to
// a multiple of 128, L layers.
//
// Thread-safety: none; one thread drives a model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/config/config.h"

namespace muster::worker {

enum class Device { kCpu, kCuda };
const char* DeviceName(Device device);  // "cpu" | "cuda", as train.yaml spells them

// How the model computes (train.yaml `precision`):
//   kFp32  fp32 storage and fp32 math everywhere (the only one on the CPU);
//   kTf32  fp32 storage, GEMMs on the tensor cores in TF32 (CUDA only);
//   kBf16  fp32 master weights, gradients and AdamW state; bf16 weight copy
//          and bf16 activations, fp32 accumulation, softmax, LayerNorm
//          statistics and loss (CUDA only).
enum class Precision { kFp32, kTf32, kBf16 };

// Resolves "auto" | "fp32" | "tf32" | "bf16" for `device`: auto is bf16 on
// CUDA and fp32 on the CPU. tf32 or bf16 on the CPU is INVALID_ARGUMENT
// naming the `precision` field.
absl::StatusOr<Precision> ResolvePrecision(const std::string& name, Device device);
const char* PrecisionName(Precision precision);

// Which attention the model runs (train.yaml `attention`):
//   kMuster  muster's own kernels: on CUDA kernels/fast/flash_attention.h
//            where the precision and shape allow (bf16 or tf32, head
//            size 64), else the GEMM attention (kernels/fast/attention.h);
//            the CPU's attention.
//   kGemm    CUDA only: the GEMM attention in every precision and shape,
//            (T, T) probabilities kept per layer (to compare against, or
//            to fall back on).
//   kCudnn   cuDNN's fused attention (kernels/fast/cudnn_attention.h):
//            CUDA only, precision kBf16, head size (dim/heads) a multiple
//            of 8 up to 128. libcudnn.so.9 is loaded at the first step.
//   kAuto    CUDA in bf16 only: kCudnn where cuDNN loads (libcudnn.so.9)
//            and takes the head size, else kMuster; the CUDA model
//            decides when it is made, and its attention() is the choice.
//            cuDNN's is the faster here (docs/benchmarks.md), and as
//            deterministic as muster's own.
enum class Attention { kMuster, kCudnn, kGemm, kAuto };

// Resolves "auto" | "muster" | "gemm" | "cudnn" for the resolved device
// and precision: auto is kAuto on CUDA in bf16, kMuster otherwise (the
// CPU, fp32, tf32: cuDNN's engines are bf16 here). gemm or cudnn off
// CUDA, or cudnn in a precision other than bf16, is INVALID_ARGUMENT
// naming the `attention` field (the head size is checked when the CUDA
// model is made).
absl::StatusOr<Attention> ResolveAttention(const std::string& name, Device device,
                                           Precision precision);
const char* AttentionName(Attention attention);

class Ops;  // worker/model/ops.h: the device back end (memory, copies, kernels)

// Resolves "cpu" | "cuda" | "auto". "cuda" without a usable GPU (or in a
// build without --config=cuda) is FAILED_PRECONDITION; "auto" falls back
// to the CPU.
absl::StatusOr<Device> ResolveDevice(const std::string& name);

struct TensorView {
  std::string name;        // "wte", "qkvw", ...
  std::vector<int> shape;  // e.g. {3 * C, C}
  size_t offset = 0;       // floats from the start of the stage buffer
  size_t size = 0;         // floats
  bool decay = false;      // AdamW weight decay applies (matrices, not
                           // biases, LayerNorm or wpe)
};

struct Stage {
  std::string name;  // "embedding", "block0", ..., "head"
  std::vector<TensorView> tensors;
  size_t size = 0;          // floats in the buffer
  float* params = nullptr;  // device memory (host memory on CPU)
  float* grads = nullptr;   // same layout
  // The bf16 copy of params the CUDA engine's GEMMs read (precision kBf16
  // only; nullptr otherwise), same layout.
  uint16_t* bf16 = nullptr;
};

// Who holds the stages' parameter and gradient buffers.
//   kOwned     the model: one allocation each, stages at aligned offsets;
//   kExternal  the caller (a sharding strategy, worker/strategy/fsdp/fsdp.h), which
//              points each stage at its buffers with BindStage before the
//              stage is used; the model allocates activations only. On
//              CUDA with kBf16 the caller also binds each stage's bf16
//              copy and keeps it equal to the fp32 parameters rounded to
//              nearest even (Ops::CastToBf16).
enum class ParamStorage { kOwned, kExternal };

// The part of the model one pipeline rank runs (worker/strategy/pipeline/pipeline.h): blocks
// [first_block, end_block), with the embedding when first_block is 0, and
// the final LayerNorm, the LM head (the tied wte, so stage 0's wte too)
// and the loss when end_block is L; activations for `slots` micro-batches
// at once. The whole model is {0, L, 1}.
struct ModelPart {
  int first_block = 0;
  int end_block = 0;
  int slots = 1;
  // PartBackwardInput and PartBackwardWeight may run on it (zero-bubble
  // schedules). It costs no memory: what the weight pass reads (each
  // block's four matmul output gradients) is kept in activations the
  // input pass is done with.
  bool split_backward = false;
};

class GptModel {
 public:
  // Allocates parameters and gradients (unless `storage` is kExternal) and
  // activations for micro-batches of up to `max_batch` sequences of up to
  // config.seq_len tokens. On the CPU the precision must be kFp32
  // (INVALID_ARGUMENT otherwise). On CUDA the model is the fused engine of
  // worker/model/model_cuda.cc; memory it cannot get is RESOURCE_EXHAUSTED
  // naming the bytes asked for and the bytes free. `attention` kCudnn needs
  // CUDA, kBf16 and a head size cuDNN takes (INVALID_ARGUMENT naming the
  // `attention` field otherwise).
  static absl::StatusOr<std::unique_ptr<GptModel>> Create(
      const ModelConfig& config, int max_batch, Device device,
      Precision precision = Precision::kFp32, ParamStorage storage = ParamStorage::kOwned,
      Attention attention = Attention::kMuster);
  // A part of the model (CPU only: UNIMPLEMENTED on CUDA;
  // INVALID_ARGUMENT for an empty or out-of-range block range or fewer
  // than 1 slot). With kOwned storage, parameters and gradients are
  // allocated for every stage, as Create does, but only the part's stages
  // are read and written; with kExternal, BindStage points the part's
  // stages (and stage 0 for the head's tied wte) at buffers the caller
  // holds: a pipeline rank that runs several parts (interleaved 1F1B)
  // binds them all to one model's buffers.
  static absl::StatusOr<std::unique_ptr<GptModel>> CreatePart(
      const ModelConfig& config, int max_batch, Device device, const ModelPart& part,
      ParamStorage storage = ParamStorage::kOwned);
  virtual ~GptModel() = default;

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  Precision precision() const { return precision_; }
  Attention attention() const { return attention_; }
  // The attention it runs, for logs: AttentionName's word, and on CUDA
  // which kernels ("muster flash", "muster GEMM"; "cudnn", and once cuDNN
  // has run, e.g. "cudnn 9.19.0").
  virtual std::string DescribeAttention() const { return AttentionName(attention_); }
  // CUDA only: from now on, run each pass's kernels on a stream of the
  // model's own, and from the second step of a shape on, replay them as a
  // CUDA graph captured then (one per shape, and per loss scale for the
  // backward). The bits are the eager run's. A Forward or Backward called
  // while a stage hook is set (a parallel strategy acts between the
  // kernels), or with kExternal storage, runs eagerly on the default
  // stream, as without graphs. UNIMPLEMENTED on the CPU; FAILED_PRECONDITION
  // if the stream cannot be made.
  virtual absl::Status EnableCudaGraphs() {
    return absl::UnimplementedError("CUDA graphs need device cuda");
  }
  // Passes replayed from a graph so far (0 unless EnableCudaGraphs).
  virtual long graph_replays() const { return 0; }
  // CUDA only, for a Backward on the model's own stream (EnableCudaGraphs,
  // no stage hook, kOwned): how many streams it runs on. 1: one, in order;
  // 2 (the default): each block's weight and bias gradients on a second
  // stream beside its input gradients. The bits are the same either way.
  // INVALID_ARGUMENT but for 1 or 2; UNIMPLEMENTED on the CPU.
  virtual absl::Status SetBackwardStreams(int streams) {
    return absl::UnimplementedError("backward streams need device cuda");
  }
  // The back end that owns this model's device memory; AdamW and
  // ClipGradNorm run their kernels through it.
  Ops& ops() const { return *ops_; }
  // The same, shared: for buffers that may outlive the model (a sharding
  // strategy's, which is destroyed after the trainer and its model).
  std::shared_ptr<Ops> shared_ops() const { return ops_; }
  // The first error of the device back end (a failed CUDA launch or copy),
  // sticky; always OK on the CPU.
  virtual absl::Status DeviceStatus() const;

  // GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, with
  // the residual projections (attprojw, fcprojw) scaled by 1/sqrt(2L);
  // zeros for biases; ones for LayerNorm weights. Same seed, same weights,
  // on any device.
  void InitWeights(uint64_t seed);
  // Stage `stage`'s part of InitWeights(seed), into `host` (the stage's
  // size floats): a sharded model initialises one stage at a time.
  void InitStageWeights(int stage, uint64_t seed, float* host) const;

  // kExternal storage: stage `stage` reads its parameters from `params`
  // (and, on CUDA with kBf16, its GEMM weights from `bf16`) and adds its
  // gradients into `grads` (any may be nullptr while the stage is not in
  // use). Device memory, the stage's size elements each.
  void BindStage(int stage, float* params, float* grads, uint16_t* bf16 = nullptr) {
    stages_[stage].params = params;
    stages_[stage].grads = grads;
    stages_[stage].bf16 = bf16;
  }

  std::vector<Stage>& stages() { return stages_; }
  const std::vector<Stage>& stages() const { return stages_; }
  size_t num_parameters() const;  // counts Vp rows of wte, as llm.c does

  // Forward pass. inputs, targets: host arrays (B, T) of token ids < V;
  // targets may be nullptr (no loss). Returns the mean cross-entropy over
  // the B*T positions (0 without targets). REQUIRES: B <= max_batch,
  // T <= seq_len.
  virtual float Forward(const int* inputs, const int* targets, int B, int T) = 0;

  // Backward pass of the last Forward (which had targets). Adds into the
  // gradient buffers, with d(loss)/d(loss) = loss_scale (1/grad_accumulation
  // for gradient accumulation).
  virtual void Backward(float loss_scale) = 0;

  // Bytes of the activations it allocated: every slot's, and the backward
  // scratch (0 where the engine does not count them).
  virtual size_t ActivationBytes() const { return 0; }
  // The part this model runs; {0, L, 1} unless made by CreatePart.
  const ModelPart& part() const { return part_; }
  // The pipeline's passes over micro-batch `slot` (0 <= slot < part.slots)
  // of a part; Forward and Backward are these for the whole model, slot 0.
  // PartForward: the first part reads the token ids `inputs` (host, (B, T)),
  // the others `activation_in` (host, (B, T, C): the previous part's
  // output). The last part reads `targets` (may be nullptr: no loss) and
  // returns the mean loss; the others write their output to
  // `activation_out` (host, (B, T, C)) and return 0.
  // PartBackward of the slot's last PartForward (the last part's had
  // targets): the last part starts from the loss, scaled by `loss_scale`;
  // the others from `grad_out`, the gradient of their output. Every part
  // but the first writes the gradient of its input to `grad_in`. Gradients
  // add into the stages' buffers.
  virtual float PartForward(int slot, const int* inputs, const int* targets,
                            const float* activation_in, float* activation_out, int B, int T);
  virtual void PartBackward(int slot, float loss_scale, const float* grad_out, float* grad_in);
  // PartBackward in two passes (zero-bubble pipelines; parts made with
  // split_backward): PartBackwardInput computes the gradient of the part's
  // input (`grad_in`) and of everything but the blocks' matmul weights
  // and biases, and keeps those matmuls' output gradients in the slot;
  // PartBackwardWeight then adds the weights' and biases' gradients from
  // them. Together they add exactly what PartBackward adds, the same bits.
  // The stage hooks fire in PartBackwardInput only.
  virtual void PartBackwardInput(int slot, float loss_scale, const float* grad_out, float* grad_in);
  virtual void PartBackwardWeight(int slot);

  // Per-stage hooks, the points where a parallel strategy acts on a stage
  // (worker/strategy/strategy.h): DDP reduces a stage's gradients once
  // post_backward fires; FSDP gathers a stage's parameters at
  // pre_forward and pre_backward. Each gets the stage index.
  //   pre_forward(s)   before the first work that reads stage s's
  //                    parameters in Forward is issued;
  //   post_forward(s)  after the last such work is issued;
  //   pre_backward(s)  before Backward issues the first work of stage s;
  //   post_backward(s) once stage s's gradients are final for this
  //                    micro-step (all their work issued).
  // Forward visits the stages in order (embedding, blocks, head) and
  // Backward in reverse (head, blocks L-1..0, embedding: the tied wte gets
  // gradient from the head and the encoder, so the embedding is last). On
  // CUDA, fused kernels read the next stage's LayerNorm weights with the
  // previous stage's residual, so pre_forward(s + 1) may fire before
  // post_forward(s); within a stage pre always comes before post. The
  // head's forward and backward also read stage 0's wte (tied). "Issued"
  // is "computed" on the CPU and "enqueued on the default stream" on CUDA
  // (where a call with hooks set runs: EnableCudaGraphs).
  struct StageHooks {
    std::function<void(int stage)> pre_forward;
    std::function<void(int stage)> post_forward;
    std::function<void(int stage)> pre_backward;
    std::function<void(int stage)> post_backward;
  };
  // Replaces the hooks (empty ones are skipped).
  void SetStageHooks(StageHooks hooks) { hooks_ = std::move(hooks); }

  // Zeroes every bound gradient buffer. (The CUDA engine with kOwned
  // storage only marks them zero: its next Backward writes over them, and
  // SettleGrads clears them for any other reader first.)
  virtual void ZeroGrad() = 0;
  // Makes the gradient buffers hold what the model says they hold, for a
  // reader other than the model's own passes (GradSumOfSquares and
  // CopyGradsToHost call it): clears gradients ZeroGrad only marked zero.
  // A strategy or optimizer that reads Stage::grads directly does so after
  // a Backward, which leaves them settled.
  virtual void SettleGrads() const {}

  // Sum of squares of every bound gradient, in double, in a fixed order.
  virtual double GradSumOfSquares();

  // Logits of the last Forward at position t of sequence b: (Vp,) copied to
  // host; entries >= V are padding. REQUIRES: that Forward had no targets
  // (with targets, the CUDA engine overwrites the logits with their
  // gradient as it computes the loss).
  virtual std::vector<float> Logits(int b, int t) const = 0;

  // Parameters as one host copy (stage order) and back: checkpoints,
  // tests, broadcast from rank 0.
  std::vector<float> CopyParamsToHost() const;
  void CopyParamsFromHost(const std::vector<float>& host);
  std::vector<float> CopyGradsToHost() const;
  // Call after writing stage.params other than through the methods here
  // or AdamW (e.g. a broadcast into the buffers): the bf16 engine then
  // refreshes its bf16 weight copy before the next Forward.
  virtual void ParamsChanged() {}
  // The bf16 copy of stage `stage`'s parameters (same layout as
  // Stage::params), which AdamW writes as it updates the fp32 weights;
  // nullptr unless the precision is kBf16.
  virtual uint16_t* ParamsBf16(int stage) { return nullptr; }
  // Floats [first, first + count) of CopyParamsToHost's layout, to and
  // from `host` (checkpoints copy only the slice a rank writes or needs).
  // REQUIRES: first + count <= TotalFloats.
  void CopyParamsRangeToHost(size_t first, size_t count, float* host) const;
  void CopyParamsRangeFromHost(size_t first, size_t count, const float* host);

  // llm.c's model file (version 3, fp32): the header and tensor order in
  // model_llmc.cc.
  absl::Status SaveLlmc(const std::string& path) const;
  absl::Status LoadLlmc(const std::string& path);

 protected:
  GptModel(const ModelConfig& config, Device device, Precision precision = Precision::kFp32,
           Attention attention = Attention::kMuster)
      : config_(config),
        device_(device),
        precision_(precision),
        attention_(attention),
        part_{0, config.layers, 1} {}

  // Tensor `index` of stage `stage`, in the parameter or gradient buffer.
  float* Param(int stage, int index) {
    return stages_[stage].params + stages_[stage].tensors[index].offset;
  }
  float* Grad(int stage, int index) {
    return stages_[stage].grads + stages_[stage].tensors[index].offset;
  }
  static void Fire(const std::function<void(int)>& hook, int stage) {
    if (hook) hook(stage);
  }
  void PreForward(int stage) { Fire(hooks_.pre_forward, stage); }
  void PostForward(int stage) { Fire(hooks_.post_forward, stage); }
  void PreBackward(int stage) { Fire(hooks_.pre_backward, stage); }
  void PostBackward(int stage) { Fire(hooks_.post_backward, stage); }

  ModelConfig config_;
  Device device_;
  Precision precision_;
  Attention attention_;
  ModelPart part_;
  std::vector<Stage> stages_;
  StageHooks hooks_;
  std::shared_ptr<Ops> ops_;
};

// Model FLOPs per token for one forward+backward (6N + attention, as in
// llm.c's MFU estimate).
double FlopsPerToken(const ModelConfig& config, int T);

}  // namespace muster::worker
