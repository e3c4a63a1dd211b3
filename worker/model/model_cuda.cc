// GptModel on CUDA: the fused engine of kernels/fast, in the manner of
// llm.c's train_gpt2.cu. Compiled only under --config=cuda.
//
// Precision (model.h): parameters, their gradients and AdamW's moments are
// always fp32 in the stage buffers, so checkpoints, clipping and data
// parallelism see the same state on every device and precision. The
// activations are "act" tensors: bf16 for kBf16, fp32 otherwise. For kBf16
// the GEMMs read a bf16 copy of the parameters (one allocation laid out as
// the fp32 one), which AdamW writes as it updates them (ParamsBf16) and
// which is refreshed before a Forward after any other write
// (ParamsChanged).
//
// With ParamStorage::kExternal (FSDP) the engine allocates activations
// only; the strategy binds each stage's fp32 parameters, gradients and, for
// kBf16, bf16 copy (Stage::bf16) before the stage runs, and keeps that
// copy current itself.
//
// Attention (model.h, Attention): kMuster runs kernels/fast's own flash
// attention where the precision and shape allow (bf16 or tf32, head size
// 64), else the GEMM attention; kCudnn runs cuDNN's fused attention (a fast::CudnnAttention
// the model owns), which keeps the same per-row statistics as flash
// attention and so the same activations.
//
// Every kernel of a step runs in order on the default stream (with
// EnableCudaGraphs, and no stage hook set and kOwned storage: UseStream, the
// passes' kernels on the model's own stream, ordered with the default one
// by events, and replayed as CUDA graphs: RunPass; the backward's weight
// gradients then on a second stream beside it: side_stream_). Forward waits for
// the losses, Backward only enqueues. The step's bits do not
// depend on scheduling: no kernel uses atomics, cuBLASLt gets the same
// algorithm for the same shape (kernels/fast/gemm.h), and cuDNN's
// attention picks only deterministic engines (cudnn_attention.h).
//
// B batch, T time, C channels, NH heads, V vocab, Vp padded vocab, L
// layers; BT = B*T rows. Activations of a layer are packed for the actual
// (B, T) at the start of a slot sized for (max_batch, seq_len).
#include <cuda_runtime.h>

#include <cassert>
#include <cstring>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/fast/adamw.h"
#include "kernels/fast/attention.h"
#include "kernels/fast/classifier.h"
#include "kernels/fast/cudnn_attention.h"
#include "kernels/fast/encoder.h"
#include "kernels/fast/flash_attention.h"
#include "kernels/fast/gemm.h"
#include "kernels/fast/layernorm.h"
#include "kernels/matmul.h"
#include "worker/model/model_cuda.h"
#include "worker/model/model_layout.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

namespace fast = ::muster::kernels::fast;

// What one block's forward pass saves for its backward pass. void* are act
// tensors.
struct Layer {
  void* ln1;        // (B, T, C)
  float* ln1_mean;  // (B, T)
  float* ln1_rstd;  // (B, T)
  void* qkv;        // (B, T, 3C)
  void* atty;       // (B, T, C) attention output, heads side by side
  void* att;        // (B, NH, T, T) probabilities; with flash attention,
                    // (B, NH, T) fp32 log2-sum-exp of the scores; with
                    // cuDNN's, (B, NH, T) fp32 natural-log sum-exp
  void* residual2;  // (B, T, C) residual + attention projection
  void* ln2;        // (B, T, C)
  float* ln2_mean;  // (B, T)
  float* ln2_rstd;  // (B, T)
  void* fch;        // (B, T, 4C) before GELU
  void* fch_gelu;   // (B, T, 4C)
  void* residual3;  // (B, T, C) the block's output
};

fast::GemmMath MathOf(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return fast::GemmMath::kBf16;
    case Precision::kTf32:
      return fast::GemmMath::kTf32;
    case Precision::kFp32:
      break;
  }
  return fast::GemmMath::kFp32;
}

std::string GemmError(int code) {
  if (code == fast::kNoGemmAlgorithm) return "cuBLASLt has no algorithm for this GEMM";
  // Above kCublasErrorBase too: before the cuBLAS codes. The model's Check
  // says cuDNN's own message instead where it has one.
  if (code == fast::kCudnnError) return "cuDNN failed";
  if (code >= kernels::kCublasErrorBase) {
    return absl::StrCat("cuBLAS status ", code - kernels::kCublasErrorBase);
  }
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

class CudaModel final : public GptModel {
 public:
  CudaModel(const ModelConfig& config, int max_batch, Precision precision, ParamStorage storage,
            Attention attention, std::unique_ptr<Ops> ops, std::unique_ptr<fast::Gemm> gemm)
      : GptModel(config, Device::kCuda, precision, attention),
        max_batch_(max_batch),
        storage_(storage),
        gemm_(std::move(gemm)),
        act_(gemm_->act()),
        act_bytes_(fast::ActBytes(act_)) {
    ops_ = std::move(ops);
    // cuDNN itself is loaded by its first Forward, not here.
    if (attention == Attention::kCudnn) cudnn_ = std::make_unique<fast::CudnnAttention>();
  }

  ~CudaModel() override {
    if (own_stream_ != nullptr) cudaStreamSynchronize(own_stream_);
    DropGraphs();
    DropSideStreams();
    cudnn_.reset();
    gemm_.reset();
    for (void* block : allocations_) ops_->Free(block);
    if (joined_ != nullptr) cudaEventDestroy(joined_);
    if (left_ != nullptr) cudaEventDestroy(left_);
    if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
  }

  absl::Status Allocate();

  float Forward(const int* inputs, const int* targets, int B, int T) override;
  void Backward(float loss_scale) override;

  // kOwned: marks the gradients zero without clearing them (grads_unset_),
  // as PyTorch's zero_grad(set_to_none=True) lets its backward do: the next
  // Backward's first writer of each gradient overwrites it, which saves
  // clearing 0.5 GB a step for GPT-2 124M and the weight GEMMs' reads of
  // what they add to. Anything else that reads the gradients first clears
  // them then (SettleGrads).
  void ZeroGrad() override {
    if (grads_base_ == nullptr) {  // kExternal: the bound buffers
      for (const Stage& stage : stages_) {
        if (stage.grads != nullptr) ops_->Zero(stage.grads, stage.size * sizeof(float));
      }
      return;
    }
    grads_unset_ = true;
  }

  // One pass over the one gradient allocation (its padding is zeros): one
  // reduction and one wait instead of one per stage.
  double GradSumOfSquares() override {
    if (grads_base_ == nullptr) return GptModel::GradSumOfSquares();  // kExternal
    SettleGrads();
    return ops_->SumOfSquares(grads_base_, param_floats_);
  }

  void SettleGrads() const override {
    if (!grads_unset_) return;
    ops_->Zero(grads_base_, param_floats_ * sizeof(float));
    grads_unset_ = false;
  }

  std::vector<float> Logits(int b, int t) const override;

  absl::Status DeviceStatus() const override {
    if (!status_.ok()) return status_;
    return ops_->status();
  }

  void ParamsChanged() override { bf16_stale_ = true; }
  uint16_t* ParamsBf16(int stage) override { return stages_[stage].bf16; }

  absl::Status EnableCudaGraphs() override {
    if (graphs_) return absl::OkStatus();
    cudaError_t made = cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking);
    if (made == cudaSuccess) made = cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming);
    if (made == cudaSuccess) made = cudaEventCreateWithFlags(&left_, cudaEventDisableTiming);
    if (made != cudaSuccess) {
      if (left_ != nullptr) cudaEventDestroy(left_);
      if (joined_ != nullptr) cudaEventDestroy(joined_);
      if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
      own_stream_ = nullptr;
      joined_ = left_ = nullptr;
      return absl::FailedPreconditionError(absl::StrCat(
          "device cuda: a stream and events for CUDA graphs: ", cudaGetErrorString(made)));
    }
    graphs_ = true;
    return MakeSideStreams();
  }
  long graph_replays() const override { return graph_replays_; }

  absl::Status SetBackwardStreams(int streams) override {
    if (streams < 1 || streams > 2) {
      return absl::InvalidArgumentError(absl::StrCat("backward streams: 1 or 2, got ", streams));
    }
    if (streams == backward_streams_) return absl::OkStatus();
    backward_streams_ = streams;
    // The backward's graphs were captured with the other streams.
    DropGraphs();
    backward_graphs_.clear();
    return graphs_ ? MakeSideStreams() : absl::OkStatus();
  }

  std::string DescribeAttention() const override {
    if (cudnn_ == nullptr) return flash_ ? "muster flash" : "muster GEMM";
    const long version = cudnn_->version();  // 91900 for 9.19.0; 0 until loaded
    if (version <= 0) return "cudnn";
    return absl::StrCat("cudnn ", version / 10000, ".", version % 10000 / 100, ".", version % 100);
  }

 private:
  // Tensor `index` of `stage` as the GEMMs read it: the bf16 copy, or the
  // fp32 master itself.
  const void* Weight(int stage, int index) {
    if (precision_ != Precision::kBf16) return Param(stage, index);
    assert(stages_[stage].bf16 != nullptr);
    return stages_[stage].bf16 + stages_[stage].tensors[index].offset;
  }

  // A pass's kernels, enqueued on stream_: the forward from the encoder to
  // the classifier, for batch_, time_ and has_targets_; the backward from
  // the head to block 0 (the encoder's backward is Backward's own).
  void EnqueueForward();
  void EnqueueBackward(float loss_scale, fast::GradWrite write);

  // One pass, by `enqueue`: eagerly, or on the model's own stream (see
  // UseStream) as a CUDA graph: the first run of a key
  // is eager (it makes every cuBLASLt plan, cuDNN plan and workspace the
  // capture then finds made), the second is captured and replayed, and
  // later ones replay. A graph bakes in every pointer and scalar its
  // kernels got, so the key holds what can change between steps: B, T
  // and, for the forward, whether targets were given; for the backward,
  // the loss scale's bits. The pointers are fixed: activations sit at
  // planned offsets for a given (B, T), and kOwned parameters, their bf16
  // copy and gradients never move.
  struct GraphKey {
    int B, T;
    uint32_t extra;
    uint32_t overwrite = 0;  // the backward's: its weight gradients written over (GradWrite)
    bool operator<(const GraphKey& o) const {
      return std::tie(B, T, extra, overwrite) < std::tie(o.B, o.T, o.extra, o.overwrite);
    }
  };
  struct Graph {
    bool ran_eagerly = false;
    cudaGraphExec_t exec = nullptr;
  };
  void RunPass(std::map<GraphKey, Graph>* graphs, const GraphKey& key,
               const std::function<void()>& enqueue);
  // Destroys the captured graphs; the next run of each key captures again.
  void DropGraphs();

  void BlockForward(int layer, const void* residual_in);
  // dresidual_ holds d loss / d(block output) on entry and d loss /
  // d(block input) on return.
  void BlockBackward(int layer, const void* residual_in, fast::GradWrite write);
  // Records the first failure of a launcher (fast.h's codes); the model's
  // DeviceStatus() reports it through ops_.
  void Check(const char* what, int code) {
    if (code != 0 && status_.ok()) {
      std::string why = GemmError(code);
      if (code == fast::kCudnnError && cudnn_ != nullptr && !cudnn_->error().empty()) {
        why = absl::StrCat("cuDNN: ", cudnn_->error());  // e.g. "cannot load cuDNN 9 (...)"
      }
      status_ = absl::InternalError(absl::StrCat("CUDA ", what, " failed: ", why));
    }
  }

  // The stream every pass's kernels run on: the default stream, or with
  // EnableCudaGraphs a non-blocking stream of the model's own. Non-blocking,
  // because while a blocking stream is being captured the default stream
  // is unusable, for every thread of the process; so Forward and Backward
  // order it with the work ops_ does on the default stream (copies,
  // zeroing, AdamW) themselves: JoinDefaultStream before their first work
  // on it, LeaveToDefaultStream after their last.
  //
  // A call with a stage hook set, or with kExternal storage, runs wholly on
  // the default stream, graphs enabled or not: a strategy's hooks issue
  // collectives that wait for the default stream's progress (parallel/'s
  // groups record their ready event there), and FSDP gathers into external
  // storage that the default stream's order protects. On the model's own
  // stream, a hook's reduction would read gradients not yet written (DDP
  // over 2 ranks lost bits from step 3 on an H200) and a ZeRO-3 forward
  // would read weights not yet gathered (its loss was NaN).
  cudaStream_t own_stream_ = nullptr;  // made by EnableCudaGraphs
  cudaStream_t stream_ = nullptr;      // this call's: own_stream_ or the default one
  // Chooses this Forward's or Backward's stream; RunPass captures graphs
  // only on the model's own.
  void UseStream() {
    const bool hooks =
        hooks_.pre_forward || hooks_.post_forward || hooks_.pre_backward || hooks_.post_backward;
    stream_ = graphs_ && !hooks && storage_ == ParamStorage::kOwned ? own_stream_ : nullptr;
    gemm_->set_stream(stream_);
    overlap_ = stream_ != nullptr && backward_streams_ > 1 && side_gemm_ != nullptr;
  }
  // Zeroes `bytes` at `ptr` in this call's order: ops_'s memset on the
  // default stream, or an asynchronous one (which a graph captures) on the
  // model's own.
  void ZeroOnStream(const char* what, void* ptr, size_t bytes) {
    if (stream_ == nullptr) {
      ops_->Zero(ptr, bytes);
      return;
    }
    Check(what, static_cast<int>(cudaMemsetAsync(ptr, 0, bytes, stream_)));
  }
  cudaEvent_t joined_ = nullptr, left_ = nullptr;
  void JoinDefaultStream() {
    if (stream_ == nullptr) return;
    Check("join the default stream", static_cast<int>(cudaEventRecord(joined_, nullptr)));
    Check("join the default stream", static_cast<int>(cudaStreamWaitEvent(stream_, joined_, 0)));
  }
  void LeaveToDefaultStream() {
    if (stream_ == nullptr) return;
    Check("return to the default stream", static_cast<int>(cudaEventRecord(left_, stream_)));
    Check("return to the default stream", static_cast<int>(cudaStreamWaitEvent(nullptr, left_, 0)));
  }

  // The backward's second stream (EnableCudaGraphs, on the model's own
  // stream only, so never with a stage hook: a strategy sees each stage's
  // gradients whole at its post_backward hook because the eager backward
  // runs in order). Each block's weight and bias gradients (its dW GEMMs
  // and bias partial sums, and the column sums' second pass) run on
  // side_stream_ beside its input gradients, the chain that the block
  // below waits for: the dW GEMMs' tails and the small kernels of one
  // stream fill SMs the other leaves idle. The side stream has a Gemm of
  // its own (cuBLASLt's workspace serves one call in flight). The marks
  // order the two by what each kernel reads and writes (BlockBackward);
  // the bits are those of one stream, as no kernel's result depends on
  // what runs beside it and both Gemms pick the same algorithm for the
  // same shape.
  enum Mark {
    kBlockIn,       // main: dresidual_ holds the block output's gradient
    kDwide,         // main: dwide_ holds the fc projection's dx (after GELU')
    kFcprojGrads,   // side: done reading dresidual_ (fc projection dW, db)
    kAfterLn2,      // main: dresidual_ holds d residual2
    kFcGrads,       // side: done reading dwide_ (fc dW, db)
    kDqkv,          // main: dwide_ holds dqkv
    kAttprojGrads,  // side: done reading dresidual_ (attention projection dW, db)
    kAfterLn1,      // main: LayerNorm 1's partial sums written
    kBlockGrads,    // side: the block's gradients whole, dwide_ free
    kMarks
  };
  int backward_streams_ = 2;
  bool overlap_ = false;              // this Backward's: on the model's own stream, with 2 streams
  bool block_grads_pending_ = false;  // kBlockGrads recorded in this pass
  cudaStream_t side_stream_ = nullptr;
  std::unique_ptr<fast::Gemm> side_gemm_;
  cudaEvent_t marks_[kMarks] = {};
  absl::Status MakeSideStreams();
  void DropSideStreams();
  // `mark` recorded on `stream` now; `waiter` waits for it. No-ops unless
  // overlap_.
  void Record(Mark mark, cudaStream_t stream) {
    if (overlap_) {
      Check("order the backward's streams",
            static_cast<int>(cudaEventRecord(marks_[mark], stream)));
    }
  }
  void Await(cudaStream_t waiter, Mark mark) {
    if (overlap_) {
      Check("order the backward's streams",
            static_cast<int>(cudaStreamWaitEvent(waiter, marks_[mark], 0)));
    }
  }
  void Signal(Mark mark, cudaStream_t from, cudaStream_t to) {
    Record(mark, from);
    Await(to, mark);
  }
  // Where this Backward's weight and bias gradients run.
  fast::Gemm& WeightGemm() { return overlap_ ? *side_gemm_ : *gemm_; }
  cudaStream_t side() const { return overlap_ ? side_stream_ : stream_; }

  bool graphs_ = false;
  std::map<GraphKey, Graph> forward_graphs_, backward_graphs_;
  long graph_replays_ = 0;
  size_t graph_workspace_ = 0;  // cuDNN's workspace bytes when the graphs were captured

  const int max_batch_;
  const ParamStorage storage_;
  std::unique_ptr<fast::Gemm> gemm_;
  const fast::ActType act_;
  const size_t act_bytes_;
  std::vector<void*> allocations_;
  absl::Status status_;

  // kOwned only (null with kExternal):
  std::vector<size_t> stage_offsets_;  // floats, in the params/grads allocations
  size_t param_floats_ = 0;            // of one allocation, padding included
  float* params_base_ = nullptr;
  float* grads_base_ = nullptr;
  // The gradients read as zero but hold stale values (ZeroGrad); the next
  // Backward writes over them, or SettleGrads clears them. kOwned only.
  // Allocate leaves them zero and unset, which is exact too, and gives the
  // first Backward the graph key of every later step's.
  mutable bool grads_unset_ = false;
  uint16_t* params_bf16_ = nullptr;  // kBf16 only
  bool bf16_stale_ = true;

  // Shape and presence of targets of the last Forward.
  int batch_ = 0, time_ = 0;
  bool has_targets_ = false;

  int* inputs_ = nullptr;   // (B, T) device copies
  int* targets_ = nullptr;  // (B, T)
  int* groups_ = nullptr;   // EncoderGroups: tokens (BT) | starts (BT + 1) | positions (BT)
  int group_count_ = 0;
  void* encoded_ = nullptr;  // (B, T, C)
  std::vector<Layer> layers_;
  void* lnf_ = nullptr;        // (B, T, C)
  float* lnf_mean_ = nullptr;  // (B, T)
  float* lnf_rstd_ = nullptr;  // (B, T)
  void* logits_ = nullptr;     // (B, T, Vp); after a Forward with targets, their gradient
  float* losses_ = nullptr;    // (B, T)
  std::vector<float> host_losses_;

  // Scratch shared by the layers.
  void* projected_ = nullptr;  // (B, T, C) attention / MLP projection before the residual add
  // (B, NH, T, T) fp32 scores, then their gradient; with flash or cuDNN
  // attention, (B, NH, T) fp32 for the backward's row sums.
  float* scores_ = nullptr;
  bool flash_ = false;  // muster's flash attention (bf16 or tf32, head size 64) or GEMMs
  fast::FlashMath flash_math_ = fast::FlashMath::kBf16;
  // kCudnn: cuDNN's attention, which then runs instead of either.
  std::unique_ptr<fast::CudnnAttention> cudnn_;
  void* dresidual_ = nullptr;  // (B, T, C)
  void* dnarrow_ = nullptr;    // (B, T, C) dlnf, dln2, datty, dln1 in turn
  void* dwide_ = nullptr;      // (B, T, 4C) dfch, then dqkv (3C)
  // The column sums' partials (kernels/fast/gemm.h): a block's backward
  // runs the second passes of its four bias and two LayerNorm gradients in
  // one launch at its end, so each keeps its own region until then. Bias:
  // fcproj (C), fc (4C), attproj (C), qkv (3C) columns; LayerNorm: ln2,
  // ln1.
  float* bias_scratch_ = nullptr;
  float* norm_scratch_ = nullptr;
};

absl::Status CudaModel::Allocate() {
  const size_t B = max_batch_, T = config_.seq_len, C = config_.dim;
  const size_t NH = config_.heads, Vp = config_.padded_vocab(), BT = B * T;

  stages_ = layout::PlanStages(config_);
  if (storage_ == ParamStorage::kOwned) {
    param_floats_ = layout::StageOffsets(stages_, &stage_offsets_);
    layout::MemoryPlanner weights;
    weights.Request(&params_base_, param_floats_);
    weights.Request(&grads_base_, param_floats_);
    if (precision_ == Precision::kBf16) weights.Request(&params_bf16_, param_floats_);
    absl::StatusOr<void*> block = ops_->Alloc(weights.total_bytes());
    if (!block.ok()) return block.status();
    allocations_.push_back(*block);
    weights.Assign(*block);
    grads_unset_ = true;
    for (size_t s = 0; s < stages_.size(); ++s) {
      stages_[s].params = params_base_ + stage_offsets_[s];
      stages_[s].grads = grads_base_ + stage_offsets_[s];
      if (params_bf16_ != nullptr) stages_[s].bf16 = params_bf16_ + stage_offsets_[s];
    }
  }

  const size_t act = act_bytes_;
  // Flash attention multiplies bf16, or TF32 operands of fp32
  // activations; exact fp32 keeps the GEMM attention.
  flash_ = cudnn_ == nullptr && attention_ != Attention::kGemm && precision_ != Precision::kFp32 &&
           fast::FlashAttentionSupports(config_.dim, config_.heads);
  flash_math_ = precision_ == Precision::kTf32 ? fast::FlashMath::kTf32 : fast::FlashMath::kBf16;
  // Per head and row: the whole (T, T) map, or one float with flash (or
  // cuDNN's) attention.
  const bool per_row = flash_ || cudnn_ != nullptr;
  const size_t attention_map = per_row ? B * NH * T * sizeof(float) : B * NH * T * T * act;
  // The backward's scratch: flash attention's (each row's delta, and dS
  // where its tiling stores it), cuDNN's row sums, or the GEMM path's
  // (T, T) map.
  const size_t attention_scratch =
      flash_ ? fast::FlashAttentionBackwardScratchFloats(flash_math_, B, T, NH)
             : (per_row ? B * NH * T : B * NH * T * T);
  layout::MemoryPlanner plan;
  plan.Request(&encoded_, BT * C * act);
  layers_.resize(config_.layers);
  for (Layer& layer : layers_) {
    plan.Request(&layer.ln1, BT * C * act);
    plan.Request(&layer.ln1_mean, BT);
    plan.Request(&layer.ln1_rstd, BT);
    plan.Request(&layer.qkv, BT * 3 * C * act);
    plan.Request(&layer.atty, BT * C * act);
    plan.Request(&layer.att, attention_map);
    plan.Request(&layer.residual2, BT * C * act);
    plan.Request(&layer.ln2, BT * C * act);
    plan.Request(&layer.ln2_mean, BT);
    plan.Request(&layer.ln2_rstd, BT);
    plan.Request(&layer.fch, BT * 4 * C * act);
    plan.Request(&layer.fch_gelu, BT * 4 * C * act);
    plan.Request(&layer.residual3, BT * C * act);
  }
  plan.Request(&lnf_, BT * C * act);
  plan.Request(&lnf_mean_, BT);
  plan.Request(&lnf_rstd_, BT);
  plan.Request(&logits_, BT * Vp * act);
  plan.Request(&losses_, BT);
  plan.Request(&projected_, BT * C * act);
  plan.Request(&scores_, attention_scratch);
  plan.Request(&dresidual_, BT * C * act);
  plan.Request(&dnarrow_, BT * C * act);
  plan.Request(&dwide_, BT * 4 * C * act);
  plan.Request(&bias_scratch_, fast::Gemm::BiasGradScratchFloats(BT, 9 * C));
  plan.Request(&norm_scratch_, 2 * fast::LayerNormBackwardScratchFloats(BT, C));
  plan.Request(&inputs_, BT);
  plan.Request(&targets_, BT);
  plan.Request(&groups_, 3 * BT + 1);
  absl::StatusOr<void*> activations = ops_->Alloc(plan.total_bytes());
  if (!activations.ok()) return activations.status();
  allocations_.push_back(*activations);
  plan.Assign(*activations);
  host_losses_.resize(BT);
  return absl::OkStatus();
}

void CudaModel::BlockForward(int layer, const void* residual_in) {
  const int B = batch_, T = time_, C = config_.dim, NH = config_.heads;
  const int BT = B * T;
  const int stage = layout::BlockStage(layer);
  Layer& a = layers_[layer];
  // a.ln1 was made by the LayerNorm fused with the previous residual add.
  Check("qkv matmul", gemm_->Forward(a.qkv, nullptr, a.ln1, Weight(stage, layout::kQkvw),
                                     Weight(stage, layout::kQkvb), BT, C, 3 * C));
  if (cudnn_ != nullptr) {
    Check("cudnn attention",
          cudnn_->Forward(a.atty, static_cast<float*>(a.att), a.qkv, B, T, C, NH, stream_));
  } else if (flash_) {
    Check("flash attention",
          fast::FlashAttentionForward(flash_math_, a.atty, static_cast<float*>(a.att), a.qkv, B, T,
                                      C, NH, stream_));
  } else {
    Check("attention", fast::AttentionForward(*gemm_, a.atty, a.att, scores_, a.qkv, B, T, C, NH));
  }
  Check("attention projection",
        gemm_->Forward(projected_, nullptr, a.atty, Weight(stage, layout::kAttprojw),
                       Weight(stage, layout::kAttprojb), BT, C, C));
  Check("residual + layernorm 2",
        fast::LayerNormForward(act_, a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, residual_in,
                               projected_, Param(stage, layout::kLn2w), Param(stage, layout::kLn2b),
                               BT, C, stream_));
  Check("fc matmul + gelu", gemm_->Forward(a.fch_gelu, a.fch, a.ln2, Weight(stage, layout::kFcw),
                                           Weight(stage, layout::kFcb), BT, C, 4 * C));
  Check("fc projection",
        gemm_->Forward(projected_, nullptr, a.fch_gelu, Weight(stage, layout::kFcprojw),
                       Weight(stage, layout::kFcprojb), BT, 4 * C, C));
  // residual3 = residual2 + projected_ is made by the caller, fused with
  // the next LayerNorm.
}

absl::Status CudaModel::MakeSideStreams() {
  if (backward_streams_ == 1 || side_gemm_ != nullptr) return absl::OkStatus();
  // Non-blocking, as own_stream_ (EnableCudaGraphs).
  cudaError_t made = cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking);
  for (cudaEvent_t& mark : marks_) {
    if (made == cudaSuccess) made = cudaEventCreateWithFlags(&mark, cudaEventDisableTiming);
  }
  int code = static_cast<int>(made);
  if (code == 0) code = fast::Gemm::Create(MathOf(precision_), side_stream_, &side_gemm_);
  if (code != 0) {
    DropSideStreams();
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: the backward's streams: ", GemmError(code)));
  }
  return absl::OkStatus();
}

void CudaModel::DropSideStreams() {
  if (side_stream_ != nullptr) cudaStreamSynchronize(side_stream_);
  side_gemm_.reset();
  for (cudaEvent_t& mark : marks_) {
    if (mark != nullptr) cudaEventDestroy(mark);
    mark = nullptr;
  }
  if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
  side_stream_ = nullptr;
}

void CudaModel::DropGraphs() {
  for (auto* all : {&forward_graphs_, &backward_graphs_}) {
    for (auto& [key, graph] : *all) {
      if (graph.exec != nullptr) cudaGraphExecDestroy(graph.exec);
      graph.exec = nullptr;
    }
  }
}

void CudaModel::RunPass(std::map<GraphKey, Graph>* graphs, const GraphKey& key,
                        const std::function<void()>& enqueue) {
  if (stream_ == nullptr || !status_.ok()) {  // no graphs, or not for this call (UseStream)
    enqueue();
    return;
  }
  // cuDNN moves its workspace to a larger allocation when a new shape
  // needs more: the graphs captured before point at the old one, so they
  // are captured again.
  const size_t workspace = cudnn_ != nullptr ? cudnn_->workspace_bytes() : 0;
  if (workspace != graph_workspace_) {
    DropGraphs();
    graph_workspace_ = workspace;
  }
  Graph& graph = (*graphs)[key];
  if (graph.exec == nullptr && !graph.ran_eagerly) {
    graph.ran_eagerly = true;
    enqueue();
    return;
  }
  if (graph.exec == nullptr) {
    // Thread-local mode: other threads (a data loader, a checkpoint
    // writer) may go on calling CUDA while this one captures.
    Check("graph capture",
          static_cast<int>(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal)));
    if (!status_.ok()) return;
    enqueue();
    cudaGraph_t captured = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &captured);
    // A launch that failed inside the capture (recorded by Check) fails
    // the step with its own message; a capture that failed is this one.
    Check("graph capture", static_cast<int>(ended));
    if (!status_.ok()) {
      if (captured != nullptr) cudaGraphDestroy(captured);
      return;
    }
    Check("graph instantiate", static_cast<int>(cudaGraphInstantiate(&graph.exec, captured, 0)));
    cudaGraphDestroy(captured);
    if (!status_.ok()) {
      graph.exec = nullptr;
      return;
    }
  }
  Check("graph launch", static_cast<int>(cudaGraphLaunch(graph.exec, stream_)));
  ++graph_replays_;
}

float CudaModel::Forward(const int* inputs, const int* targets, int B, int T) {
  assert(B >= 1 && B <= max_batch_ && T >= 1 && T <= config_.seq_len);
  batch_ = B;
  time_ = T;
  has_targets_ = targets != nullptr;
  const int BT = B * T;
#ifndef NDEBUG
  const int V = config_.vocab;
  for (int i = 0; i < BT; ++i) {
    assert(inputs[i] >= 0 && inputs[i] < V);
    assert(targets == nullptr || (targets[i] >= 0 && targets[i] < V));
  }
#endif
  ops_->ToDevice(inputs_, inputs, BT * sizeof(int));
  if (has_targets_) ops_->ToDevice(targets_, targets, BT * sizeof(int));
  // After the copies, and whatever wrote the parameters, on the default
  // stream.
  UseStream();
  JoinDefaultStream();
  if (params_bf16_ != nullptr && bf16_stale_) {
    Check("bf16 weight copy", fast::CastToBf16(params_bf16_, params_base_, param_floats_, stream_));
    bf16_stale_ = false;
  }
  RunPass(&forward_graphs_, {B, T, has_targets_ ? 1u : 0u}, [this] { EnqueueForward(); });
  LeaveToDefaultStream();
  if (!has_targets_) return 0.0f;

  // The encoder's backward sums each token's rows: group them on the host
  // while the GPU runs the forward pass enqueued above.
  fast::EncoderGroups groups = fast::GroupByToken(inputs, BT);
  group_count_ = groups.groups();
  std::vector<int> packed;
  packed.reserve(3 * BT + 1);
  packed.insert(packed.end(), groups.tokens.begin(), groups.tokens.end());
  packed.insert(packed.end(), groups.starts.begin(), groups.starts.end());
  packed.insert(packed.end(), groups.positions.begin(), groups.positions.end());
  ops_->ToDevice(groups_, packed.data(), packed.size() * sizeof(int));

  ops_->ToHost(host_losses_.data(), losses_, BT * sizeof(float));
  double sum = 0.0;  // in a fixed order, so the mean is deterministic
  for (int row = 0; row < BT; ++row) sum += host_losses_[row];
  return static_cast<float>(sum / static_cast<double>(BT));
}

void CudaModel::EnqueueForward() {
  const int B = batch_, T = time_, C = config_.dim, V = config_.vocab, Vp = config_.padded_vocab(),
            L = config_.layers;
  const int BT = B * T;
  PreForward(0);
  Check("encoder", fast::EncoderForward(act_, encoded_, inputs_, Param(0, layout::kWte),
                                        Param(0, layout::kWpe), B, T, C, stream_));
  PostForward(0);
  // Each block's LayerNorm 1 (and the head's final one) is fused with the
  // residual of the stage before: the next stage's hook comes first.
  PreForward(1);
  Check("layernorm 1",
        fast::LayerNormForward(act_, layers_[0].ln1, layers_[0].ln1_mean, layers_[0].ln1_rstd,
                               nullptr, encoded_, nullptr, Param(1, layout::kLn1w),
                               Param(1, layout::kLn1b), BT, C, stream_));
  const void* residual = encoded_;
  const int head = layout::HeadStage(config_);
  for (int layer = 0; layer < L; ++layer) {
    BlockForward(layer, residual);
    Layer& a = layers_[layer];
    const bool last = layer + 1 == L;
    Layer* next = last ? nullptr : &layers_[layer + 1];
    const int next_stage = last ? head : layout::BlockStage(layer + 1);
    PreForward(next_stage);
    Check("residual + layernorm",
          fast::LayerNormForward(
              act_, last ? lnf_ : next->ln1, last ? lnf_mean_ : next->ln1_mean,
              last ? lnf_rstd_ : next->ln1_rstd, a.residual3, a.residual2, projected_,
              Param(next_stage, last ? int{layout::kLnfw} : int{layout::kLn1w}),
              Param(next_stage, last ? int{layout::kLnfb} : int{layout::kLn1b}), BT, C, stream_));
    PostForward(layout::BlockStage(layer));
    residual = a.residual3;
  }
  // The LM head is wte, tied: logits (BT, Vp) = lnf (BT, C) @ wte^T.
  Check("lm head",
        gemm_->Forward(logits_, nullptr, lnf_, Weight(0, layout::kWte), nullptr, BT, C, Vp));
  PostForward(head);
  if (!has_targets_) return;

  // The mean loss has gradient 1/BT per row; Backward's loss_scale is
  // applied by the head's GEMMs.
  Check("classifier",
        fast::ClassifierForward(act_, losses_, logits_, targets_, 1.0f / static_cast<float>(BT),
                                true, BT, V, Vp, stream_));
}

void CudaModel::BlockBackward(int layer, const void* residual_in, fast::GradWrite write) {
  const int B = batch_, T = time_, C = config_.dim, NH = config_.heads;
  const int BT = B * T;
  const int stage = layout::BlockStage(layer);
  Layer& a = layers_[layer];
  // The bias and LayerNorm gradients' second passes, run together at the
  // end; each partial sums' region (bias_scratch_, norm_scratch_) by its
  // first column, the partials being (chunks, columns) for the rows BT.
  fast::ColumnSumsBatch sums;
  auto bias_scratch = [&](int first_column) {
    return bias_scratch_ + fast::Gemm::BiasGradScratchFloats(BT, first_column);
  };
  float* const ln2_scratch = norm_scratch_;
  float* const ln1_scratch = norm_scratch_ + fast::LayerNormBackwardScratchFloats(BT, C);
  // With overlap_, the weight and bias gradients (dW, db: `weights`, on
  // side()) run beside the input gradients (dx, LayerNorm, attention:
  // stream_). The side stream reads dresidual_ and dwide_, which the main
  // stream writes next, so each write waits for the reads before it: the
  // Await calls. The column sums' second pass runs last on the side
  // stream, after LayerNorm 1's partials. Without overlap_ every mark is a
  // no-op and the order is the same on one stream.
  // Every job is added before the one Flush below: a Flush inside Add (a
  // full batch) would run on the stream of the job being added.
  static_assert(fast::ColumnSumsBatch::kMaxJobs >= 6, "a block's six second passes in one batch");
  fast::Gemm& weights = WeightGemm();
  Signal(kBlockIn, stream_, side());
  // residual3 = residual2 + fcproj: both get dresidual unchanged, so the
  // projection's gradient is read from dresidual_.
  Check("fc projection dW", weights.BackwardWeight(Grad(stage, layout::kFcprojw), write, dresidual_,
                                                   a.fch_gelu, BT, 4 * C, C, 1.0f));
  Check("fc projection db", weights.BackwardBias(Grad(stage, layout::kFcprojb), write, dresidual_,
                                                 BT, C, bias_scratch(0), &sums));
  Record(kFcprojGrads, side());
  // dwide_ is written next: the block above's qkv dW and db read it.
  if (block_grads_pending_) Await(stream_, kBlockGrads);
  // dfch = (dresidual @ Wfcproj) * GELU'(fch), in the GEMM's epilogue.
  Check("fc projection dx + gelu",
        gemm_->BackwardInput(dwide_, dresidual_, Weight(stage, layout::kFcprojw), a.fch, BT, 4 * C,
                             C, 1.0f));
  Signal(kDwide, stream_, side());
  Check("fc dW", weights.BackwardWeight(Grad(stage, layout::kFcw), write, dwide_, a.ln2, BT, C,
                                        4 * C, 1.0f));
  Check("fc db", weights.BackwardBias(Grad(stage, layout::kFcb), write, dwide_, BT, 4 * C,
                                      bias_scratch(C), &sums));
  Record(kFcGrads, side());
  Check("fc dx", gemm_->BackwardInput(dnarrow_, dwide_, Weight(stage, layout::kFcw), nullptr, BT, C,
                                      4 * C, 1.0f));
  // LayerNorm's backward adds into dresidual_, which becomes d loss /
  // d residual2 (the skip path plus the MLP path); and its partials go to
  // ln2_scratch, which the block above's second pass read before
  // kFcprojGrads on the side stream.
  Await(stream_, kFcprojGrads);
  Check("layernorm 2 backward",
        fast::LayerNormBackward(act_, dresidual_, Grad(stage, layout::kLn2w),
                                Grad(stage, layout::kLn2b), write, dnarrow_, a.residual2,
                                Param(stage, layout::kLn2w), a.ln2_mean, a.ln2_rstd, BT, C,
                                ln2_scratch, stream_, &sums));
  Signal(kAfterLn2, stream_, side());
  // residual2 = residual_in + attproj: the same pass-through as above.
  Check("attention projection dW", weights.BackwardWeight(Grad(stage, layout::kAttprojw), write,
                                                          dresidual_, a.atty, BT, C, C, 1.0f));
  Check("attention projection db",
        weights.BackwardBias(Grad(stage, layout::kAttprojb), write, dresidual_, BT, C,
                             bias_scratch(5 * C), &sums));
  Record(kAttprojGrads, side());
  Check("attention projection dx",
        gemm_->BackwardInput(dnarrow_, dresidual_, Weight(stage, layout::kAttprojw), nullptr, BT, C,
                             C, 1.0f));
  // dqkv into dwide_ (its first BT * 3C), after fc dW and db read it;
  // consumes a.att.
  Await(stream_, kFcGrads);
  if (cudnn_ != nullptr) {
    Check("cudnn attention backward",
          cudnn_->Backward(dwide_, scores_, dnarrow_, a.atty, a.qkv,
                           static_cast<const float*>(a.att), B, T, C, NH, stream_));
  } else if (flash_) {
    Check("flash attention backward",
          fast::FlashAttentionBackward(flash_math_, dwide_, scores_, dnarrow_, a.atty, a.qkv,
                                       static_cast<const float*>(a.att), B, T, C, NH, stream_));
  } else {
    Check("attention backward",
          fast::AttentionBackward(*gemm_, dwide_, scores_, a.att, dnarrow_, a.qkv, B, T, C, NH));
  }
  Signal(kDqkv, stream_, side());
  Check("qkv dW", weights.BackwardWeight(Grad(stage, layout::kQkvw), write, dwide_, a.ln1, BT, C,
                                         3 * C, 1.0f));
  Check("qkv db", weights.BackwardBias(Grad(stage, layout::kQkvb), write, dwide_, BT, 3 * C,
                                       bias_scratch(6 * C), &sums));
  Check("qkv dx", gemm_->BackwardInput(dnarrow_, dwide_, Weight(stage, layout::kQkvw), nullptr, BT,
                                       C, 3 * C, 1.0f));
  // LayerNorm 1 adds into dresidual_, after the attention projection's dW
  // and db read it.
  Await(stream_, kAttprojGrads);
  Check("layernorm 1 backward",
        fast::LayerNormBackward(act_, dresidual_, Grad(stage, layout::kLn1w),
                                Grad(stage, layout::kLn1b), write, dnarrow_, residual_in,
                                Param(stage, layout::kLn1w), a.ln1_mean, a.ln1_rstd, BT, C,
                                ln1_scratch, stream_, &sums));
  Signal(kAfterLn1, stream_, side());
  Check("column sums", sums.Flush(side()));
  Record(kBlockGrads, side());
  block_grads_pending_ = overlap_;
}

void CudaModel::Backward(float loss_scale) {
  assert(has_targets_);
  const int B = batch_, T = time_, C = config_.dim;
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &loss_scale, sizeof(scale_bits));
  // The first Backward since ZeroGrad writes over every gradient (the LM
  // head's GEMM writes all of wte's rows before the encoder adds to them);
  // later ones (gradient accumulation) add.
  const fast::GradWrite write = grads_unset_ ? fast::GradWrite::kOverwrite : fast::GradWrite::kAdd;
  grads_unset_ = false;
  UseStream();
  JoinDefaultStream();  // after the token groups' copy and whatever last read the gradients
  RunPass(&backward_graphs_, {B, T, scale_bits, write == fast::GradWrite::kOverwrite ? 1u : 0u},
          [this, loss_scale, write] { EnqueueBackward(loss_scale, write); });

  PreBackward(0);
  float* const dwpe = Grad(0, layout::kWpe);
  if (write == fast::GradWrite::kOverwrite && T < config_.seq_len) {
    // The encoder writes wpe's rows [0, T) only; the rest would keep an
    // earlier step's gradient.
    ZeroOnStream("zero wpe's unused rows", dwpe + static_cast<size_t>(T) * C,
                 static_cast<size_t>(config_.seq_len - T) * C * sizeof(float));
  }
  const int* group_tokens = groups_;
  const int* group_starts = groups_ + group_count_;
  const int* positions = group_starts + group_count_ + 1;
  Check("encoder backward",
        fast::EncoderBackward(act_, Grad(0, layout::kWte), dwpe, write, dresidual_, group_tokens,
                              group_starts, positions, group_count_, B, T, C, stream_));
  PostBackward(0);
  LeaveToDefaultStream();
}

// Backward's work from the head down to block 0: everything but the
// encoder's, whose launch depends on the batch's tokens (group_count_).
void CudaModel::EnqueueBackward(float loss_scale, fast::GradWrite write) {
  const int B = batch_, T = time_, C = config_.dim, Vp = config_.padded_vocab();
  const int BT = B * T;
  const int head = layout::HeadStage(config_);

  // logits_ holds d(mean loss)/d logits; loss_scale scales both GEMMs.
  // (A third stream for the head's dW, the step's largest GEMM, beside
  // everything after it, measured no faster on an H100: docs/cuda-engine.md.)
  PreBackward(head);
  block_grads_pending_ = false;
  Check("lm head dx", gemm_->BackwardInput(dnarrow_, logits_, Weight(0, layout::kWte), nullptr, BT,
                                           C, Vp, loss_scale));
  // dwte gets the head's share here (padded columns of dlogits are zero,
  // so wte's padded rows get none) and the encoder's share last.
  Check("lm head dW",
        gemm_->BackwardWeight(Grad(0, layout::kWte), write, logits_, lnf_, BT, C, Vp, loss_scale));
  ZeroOnStream("zero dresidual", dresidual_, static_cast<size_t>(BT) * C * act_bytes_);
  const void* last_residual = layers_.back().residual3;
  Check("layernorm f backward",
        fast::LayerNormBackward(act_, dresidual_, Grad(head, layout::kLnfw),
                                Grad(head, layout::kLnfb), write, dnarrow_, last_residual,
                                Param(head, layout::kLnfw), lnf_mean_, lnf_rstd_, BT, C,
                                norm_scratch_, stream_));
  PostBackward(head);

  for (int layer = config_.layers - 1; layer >= 0; --layer) {
    PreBackward(layout::BlockStage(layer));
    BlockBackward(layer, layer > 0 ? layers_[layer - 1].residual3 : encoded_, write);
    PostBackward(layout::BlockStage(layer));
  }
  // The side stream joins this one again (a capture must end so).
  if (block_grads_pending_) Await(stream_, kBlockGrads);
}

std::vector<float> CudaModel::Logits(int b, int t) const {
  assert(b < batch_ && t < time_ && !has_targets_);
  const int Vp = config_.padded_vocab();
  const size_t offset = (static_cast<size_t>(b) * time_ + t) * Vp;
  std::vector<float> row(Vp);
  if (act_ == fast::ActType::kF32) {
    ops_->ToHost(row.data(), static_cast<const float*>(logits_) + offset, Vp * sizeof(float));
    return row;
  }
  std::vector<uint16_t> bits(Vp);
  ops_->ToHost(bits.data(), static_cast<const uint16_t*>(logits_) + offset, Vp * sizeof(uint16_t));
  for (int v = 0; v < Vp; ++v) {
    const uint32_t word = static_cast<uint32_t>(bits[v]) << 16;  // bf16 is fp32's top half
    std::memcpy(&row[v], &word, sizeof(float));
  }
  return row;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GptModel>> CreateCudaModel(const ModelConfig& config, int max_batch,
                                                          Precision precision, ParamStorage storage,
                                                          Attention attention) {
  const int head_size = config.dim / config.heads;
  if (attention == Attention::kAuto) {
    // cuDNN where it loads and takes this shape (model.h, kAuto); loading
    // it here, not at the first step, lets the start-up line name it.
    attention =
        precision == Precision::kBf16 &&
                fast::CudnnAttentionSupports(fast::ActType::kBf16, config.dim, config.heads) &&
                fast::CudnnAttentionLoads()
            ? Attention::kCudnn
            : Attention::kMuster;
  }
  if (!fast::RowWidthOk(config.dim) || !fast::RowWidthOk(head_size)) {
    return absl::InvalidArgumentError(absl::StrCat("model: on CUDA, model.dim (", config.dim,
                                                   ") and the head size dim/heads (", head_size,
                                                   ") must be multiples of ", fast::kRowMultiple));
  }
  // GptModel::Create has checked the precision (bf16): the shape is cuDNN's
  // rule, which the config's validation restates.
  if (attention == Attention::kCudnn &&
      !fast::CudnnAttentionSupports(fast::ActType::kBf16, config.dim, config.heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: cudnn needs a head size (model.dim / model.heads) that is a multiple of 8 and "
        "at most 128; ",
        config.dim, " / ", config.heads, " is ", head_size));
  }
  absl::StatusOr<std::unique_ptr<Ops>> ops = MakeCudaOps();
  if (!ops.ok()) return ops.status();
  std::unique_ptr<fast::Gemm> gemm;
  if (int code = fast::Gemm::Create(MathOf(precision), nullptr, &gemm); code != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda: cuBLASLt set-up failed: ", GemmError(code)));
  }
  auto model = std::make_unique<CudaModel>(config, max_batch, precision, storage, attention,
                                           std::move(*ops), std::move(gemm));
  if (absl::Status allocated = model->Allocate(); !allocated.ok()) return allocated;
  return std::unique_ptr<GptModel>(std::move(model));
}

}  // namespace muster::worker
