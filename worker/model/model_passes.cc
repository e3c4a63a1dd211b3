// GptModel's forward and backward passes, op by op as llm.c's
// train_gpt2.c, on any Ops back end. All memory is planned and allocated
// once in Create: parameters and gradients (one allocation each, stages at
// aligned offsets), the activations the backward pass reads, and the
// activation-gradient scratch.
//
// B batch, T time, C channels, NH heads, V vocab, Vp padded vocab, L
// layers; BT = B*T rows. Activations of a layer are packed for the actual
// (B, T) at the start of a slot sized for (max_batch, seq_len).
#include <cassert>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "worker/model/model.h"
#include "worker/model/model_cuda.h"
#include "worker/model/model_layout.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

using layout::BlockTensor;

// What one block's forward pass saves for its backward pass.
struct LayerActivations {
  float* ln1;        // (B, T, C)
  float* ln1_mean;   // (B, T)
  float* ln1_rstd;   // (B, T)
  float* qkv;        // (B, T, 3C)
  float* atty;       // (B, T, C) attention output, per head concatenated
  float* att;        // (B, NH, T, T) softmax probabilities
  float* residual2;  // (B, T, C) residual + attention projection
  float* ln2;        // (B, T, C)
  float* ln2_mean;   // (B, T)
  float* ln2_rstd;   // (B, T)
  float* fch;        // (B, T, 4C) before GELU
  float* fch_gelu;   // (B, T, 4C)
  float* residual3;  // (B, T, C) the block's output
};

class GptModelImpl final : public GptModel {
 public:
  GptModelImpl(const ModelConfig& config, int max_batch, Device device, std::unique_ptr<Ops> ops,
               ParamStorage storage, const ModelPart& part)
      : GptModel(config, device), max_batch_(max_batch), storage_(storage) {
    ops_ = std::move(ops);
    part_ = part;
  }

  ~GptModelImpl() override {
    for (void* block : allocations_) ops_->Free(block);
  }

  absl::Status Allocate();

  float Forward(const int* inputs, const int* targets, int B, int T) override {
    return PartForward(0, inputs, targets, nullptr, nullptr, B, T);
  }
  void Backward(float loss_scale) override { PartBackward(0, loss_scale, nullptr, nullptr); }
  float PartForward(int slot, const int* inputs, const int* targets, const float* activation_in,
                    float* activation_out, int B, int T) override;
  void PartBackward(int slot, float loss_scale, const float* grad_out, float* grad_in) override {
    Backward(slot, loss_scale, grad_out, grad_in, /*defer_weights=*/false);
  }
  void PartBackwardInput(int slot, float loss_scale, const float* grad_out,
                         float* grad_in) override {
    assert(part_.split_backward);
    Backward(slot, loss_scale, grad_out, grad_in, /*defer_weights=*/true);
  }
  void PartBackwardWeight(int slot) override;

  size_t ActivationBytes() const override { return activation_bytes_; }

  void ZeroGrad() override {
    for (Stage& stage : stages_) {
      if (stage.grads != nullptr) ops_->Zero(stage.grads, stage.size * sizeof(float));
    }
  }

  std::vector<float> Logits(int b, int t) const override {
    assert(b < slot_->batch && t < slot_->time && slot_->logits != nullptr);
    const int Vp = config_.padded_vocab();
    std::vector<float> row(Vp);
    ops_->ToHost(row.data(), slot_->logits + (static_cast<size_t>(b) * slot_->time + t) * Vp,
                 Vp * sizeof(float));
    return row;
  }

 private:
  // A block's matmul output gradients, kept from PartBackwardInput for
  // PartBackwardWeight (split_backward parts). They take no memory of
  // their own: each lives in a buffer of the block's activations that the
  // input-gradient pass has read for the last time when it is written
  // (see BlockBackward), so a split slot is the size of a plain one and a
  // zero-bubble pipeline holds what 1F1B holds per micro-batch in flight.
  struct LayerOutputGrads {
    float* fcproj;   // (B, T, C)  in residual3: read last by the next block's backward
    float* fch;      // (B, T, 4C) in fch: GELU's backward computes it in place
    float* attproj;  // (B, T, C)  in residual2: read last by ln2's backward
    float* qkv;      // (B, T, 3C) in qkv: copied there after attention's backward
  };
  static LayerOutputGrads OutputGradsIn(const LayerActivations& a) {
    return {a.residual3, a.fch, a.residual2, a.qkv};
  }
  // One micro-batch's activations: what its backward reads. Only the
  // buffers of the part's own stages exist (the others are nullptr).
  struct Slot {
    int batch = 0, time = 0;  // of its Forward
    bool has_targets = false;
    int* inputs = nullptr;                 // (B, T) device copy: the encoder's backward
    int* targets = nullptr;                // (B, T) reads the tokens after Forward returns
    float* encoded = nullptr;              // (B, T, C) first part
    float* input = nullptr;                // (B, T, C) the previous part's output
    std::vector<LayerActivations> layers;  // the part's blocks
    float* lnf = nullptr;                  // (B, T, C) last part
    float* lnf_mean = nullptr;             // (B, T)
    float* lnf_rstd = nullptr;             // (B, T)
    float* logits = nullptr;               // (B, T, Vp)
    float* lse = nullptr;                  // (B, T)
    float* losses = nullptr;               // (B, T)
  };

  // Makes `slot` the one the passes read and write.
  void Use(int slot) {
    assert(slot >= 0 && slot < static_cast<int>(slots_.size()));
    slot_ = &slots_[slot];
    batch_ = slot_->batch;
    time_ = slot_->time;
  }
  bool first_part() const { return part_.first_block == 0; }
  bool last_part() const { return part_.end_block == config_.layers; }
  // The input of block `layer` in the current slot.
  const float* BlockInput(int layer) const {
    if (layer > part_.first_block) return slot_->layers[layer - 1 - part_.first_block].residual3;
    return first_part() ? slot_->encoded : slot_->input;
  }

  void BlockForward(int layer, const float* residual_in);
  // PartBackward, or with `defer_weights` PartBackwardInput.
  void Backward(int slot, float loss_scale, const float* grad_out, float* grad_in,
                bool defer_weights);
  // dresidual_ holds d loss / d(block output) on entry and d loss /
  // d(block input) on return. With `douts`, the matmuls' weight and bias
  // gradients are left for later and their output gradients kept there.
  void BlockBackward(int layer, const float* residual_in, const LayerOutputGrads* douts);

  const int max_batch_;
  const ParamStorage storage_;
  std::vector<void*> allocations_;

  std::vector<Slot> slots_;
  Slot* slot_ = nullptr;
  size_t activation_bytes_ = 0;     // every slot's buffers and the backward scratch
  int batch_ = 0, time_ = 0;        // the current slot's
  std::vector<float> host_losses_;  // (B, T)

  // Backward scratch, shared by the slots and reused by every layer (see
  // BlockBackward).
  float* dlogits_ = nullptr;    // (B, T, Vp) last part
  float* dresidual_ = nullptr;  // (B, T, C) gradient of the residual stream
  float* dnarrow_ = nullptr;    // (B, T, C) dlnf, dln2, datty, dln1 in turn
  float* dwide_ = nullptr;      // (B, T, 4C) dfch, then dqkv (3C)
  float* dpreatt_ = nullptr;    // (B, NH, T, T)
};

absl::Status GptModelImpl::Allocate() {
  stages_ = layout::PlanStages(config_);
  std::vector<size_t> offsets;
  const size_t param_floats = layout::StageOffsets(stages_, &offsets);
  for (bool grads : {false, true}) {
    if (storage_ == ParamStorage::kExternal) break;  // BindStage points them
    absl::StatusOr<void*> block = ops_->Alloc(param_floats * sizeof(float));
    if (!block.ok()) return block.status();
    allocations_.push_back(*block);
    for (size_t s = 0; s < stages_.size(); ++s) {
      float* start = static_cast<float*>(*block) + offsets[s];
      (grads ? stages_[s].grads : stages_[s].params) = start;
    }
  }

  const size_t B = max_batch_, T = config_.seq_len, C = config_.dim;
  const size_t NH = config_.heads, Vp = config_.padded_vocab(), BT = B * T;
  layout::MemoryPlanner plan;
  slots_.resize(part_.slots);
  for (Slot& slot : slots_) {
    if (first_part()) {
      plan.Request(&slot.encoded, BT * C);
    } else {
      plan.Request(&slot.input, BT * C);
    }
    slot.layers.resize(part_.end_block - part_.first_block);
    for (LayerActivations& layer : slot.layers) {
      plan.Request(&layer.ln1, BT * C);
      plan.Request(&layer.ln1_mean, BT);
      plan.Request(&layer.ln1_rstd, BT);
      plan.Request(&layer.qkv, BT * 3 * C);
      plan.Request(&layer.atty, BT * C);
      plan.Request(&layer.att, B * NH * T * T);
      plan.Request(&layer.residual2, BT * C);
      plan.Request(&layer.ln2, BT * C);
      plan.Request(&layer.ln2_mean, BT);
      plan.Request(&layer.ln2_rstd, BT);
      plan.Request(&layer.fch, BT * 4 * C);
      plan.Request(&layer.fch_gelu, BT * 4 * C);
      plan.Request(&layer.residual3, BT * C);
    }
    if (last_part()) {
      plan.Request(&slot.lnf, BT * C);
      plan.Request(&slot.lnf_mean, BT);
      plan.Request(&slot.lnf_rstd, BT);
      plan.Request(&slot.logits, BT * Vp);
      plan.Request(&slot.lse, BT);
      plan.Request(&slot.losses, BT);
    }
    plan.Request(&slot.inputs, BT);
    plan.Request(&slot.targets, BT);
  }
  if (last_part()) plan.Request(&dlogits_, BT * Vp);
  plan.Request(&dresidual_, BT * C);
  plan.Request(&dnarrow_, BT * C);
  plan.Request(&dwide_, BT * 4 * C);
  plan.Request(&dpreatt_, B * NH * T * T);
  activation_bytes_ = plan.total_bytes();
  absl::StatusOr<void*> activations = ops_->Alloc(plan.total_bytes());
  if (!activations.ok()) return activations.status();
  allocations_.push_back(*activations);
  plan.Assign(*activations);
  host_losses_.resize(BT);
  Use(0);
  return absl::OkStatus();
}

void GptModelImpl::BlockForward(int layer, const float* residual_in) {
  const int B = batch_, T = time_, C = config_.dim, NH = config_.heads;
  const size_t BT = static_cast<size_t>(B) * T;
  const int stage = layout::BlockStage(layer);
  LayerActivations& a = slot_->layers[layer - part_.first_block];
  ops_->LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, residual_in, Param(stage, layout::kLn1w),
                         Param(stage, layout::kLn1b), BT, C);
  ops_->MatmulForward(a.qkv, a.ln1, Param(stage, layout::kQkvw), Param(stage, layout::kQkvb), BT, C,
                      3 * C);
  ops_->AttentionForward(a.atty, a.att, a.qkv, B, T, C, NH);
  // The projection is written straight into residual2 and the residual
  // added in place: llm.c's separate attproj buffer is never read back.
  ops_->MatmulForward(a.residual2, a.atty, Param(stage, layout::kAttprojw),
                      Param(stage, layout::kAttprojb), BT, C, C);
  ops_->ResidualForward(a.residual2, residual_in, a.residual2, BT * C);
  ops_->LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, Param(stage, layout::kLn2w),
                         Param(stage, layout::kLn2b), BT, C);
  ops_->MatmulForward(a.fch, a.ln2, Param(stage, layout::kFcw), Param(stage, layout::kFcb), BT, C,
                      4 * C);
  ops_->GeluForward(a.fch_gelu, a.fch, BT * 4 * C);
  ops_->MatmulForward(a.residual3, a.fch_gelu, Param(stage, layout::kFcprojw),
                      Param(stage, layout::kFcprojb), BT, 4 * C, C);
  ops_->ResidualForward(a.residual3, a.residual2, a.residual3, BT * C);
}

float GptModelImpl::PartForward(int slot, const int* inputs, const int* targets,
                                const float* activation_in, float* activation_out, int B, int T) {
  assert(B >= 1 && B <= max_batch_ && T >= 1 && T <= config_.seq_len);
  slots_[slot].batch = B;
  slots_[slot].time = T;
  slots_[slot].has_targets = last_part() && targets != nullptr;
  Use(slot);
  Slot& s = *slot_;
  const int C = config_.dim, V = config_.vocab, Vp = config_.padded_vocab();
  const size_t BT = static_cast<size_t>(B) * T;
#ifndef NDEBUG
  // An id >= V would read outside wte (inputs) or pick a padded logit.
  for (size_t i = 0; i < BT; ++i) {
    assert(!first_part() || (inputs[i] >= 0 && inputs[i] < V));
    assert(!s.has_targets || (targets[i] >= 0 && targets[i] < V));
  }
#endif
  if (first_part()) {
    ops_->ToDevice(s.inputs, inputs, BT * sizeof(int));
  } else {
    ops_->ToDevice(s.input, activation_in, BT * C * sizeof(float));
  }
  if (s.has_targets) ops_->ToDevice(s.targets, targets, BT * sizeof(int));

  if (first_part()) {
    PreForward(0);
    ops_->EncoderForward(s.encoded, s.inputs, Param(0, layout::kWte), Param(0, layout::kWpe), B, T,
                         C);
    PostForward(0);
  }
  for (int layer = part_.first_block; layer < part_.end_block; ++layer) {
    PreForward(layout::BlockStage(layer));
    BlockForward(layer, BlockInput(layer));
    PostForward(layout::BlockStage(layer));
  }
  const float* residual = BlockInput(part_.end_block);
  if (!last_part()) {
    ops_->ToHost(activation_out, residual, BT * C * sizeof(float));
    return 0.0f;
  }
  const int head = layout::HeadStage(config_);
  PreForward(head);
  ops_->LayerNormForward(s.lnf, s.lnf_mean, s.lnf_rstd, residual, Param(head, layout::kLnfw),
                         Param(head, layout::kLnfb), BT, C);
  // The LM head is wte, tied: logits (BT, Vp) = lnf (BT, C) @ wte^T.
  ops_->MatmulForward(s.logits, s.lnf, Param(0, layout::kWte), nullptr, BT, C, Vp);
  PostForward(head);
  if (!s.has_targets) return 0.0f;

  ops_->CrossEntropyForward(s.losses, s.lse, s.logits, s.targets, BT, V, Vp);
  ops_->ToHost(host_losses_.data(), s.losses, BT * sizeof(float));
  double sum = 0.0;  // in a fixed order, so the mean is deterministic
  for (size_t row = 0; row < BT; ++row) sum += host_losses_[row];
  return static_cast<float>(sum / static_cast<double>(BT));
}

void GptModelImpl::BlockBackward(int layer, const float* residual_in,
                                 const LayerOutputGrads* douts) {
  const int B = batch_, T = time_, C = config_.dim, NH = config_.heads;
  const size_t BT = static_cast<size_t>(B) * T;
  const int stage = layout::BlockStage(layer);
  const LayerActivations& a = slot_->layers[layer - part_.first_block];
  // A matmul's weight and bias gradients, now or (douts) later.
  auto dweight = [&](int tensor) { return douts != nullptr ? nullptr : Grad(stage, tensor); };
  // Output gradients PartBackwardWeight reads (douts: views of this
  // block's activations, LayerOutputGrads), each written once the buffer
  // under it has been read for the last time. The residual stream's are
  // copied (it changes on; with memcpy, as split parts are CPU only,
  // CreatePart). residual3 = residual2 + fcproj: both get dresidual
  // unchanged, so fcproj's output gradient is dresidual_ now; residual3
  // (this block's output) was read last by the next block's backward.
  if (douts != nullptr) std::memcpy(douts->fcproj, dresidual_, BT * C * sizeof(float));
  ops_->Zero(dwide_, BT * 4 * C * sizeof(float));
  ops_->MatmulBackward(dwide_, dweight(layout::kFcprojw), dweight(layout::kFcprojb), dresidual_,
                       a.fch_gelu, Param(stage, layout::kFcprojw), BT, 4 * C, C);
  // dfch_gelu -> dfch; kept, it overwrites fch itself (GELU's backward is
  // elementwise and may run in place).
  float* dfch = douts != nullptr ? douts->fch : dwide_;
  ops_->GeluBackward(dfch, a.fch, dwide_, BT * 4 * C);
  ops_->Zero(dnarrow_, BT * C * sizeof(float));
  ops_->MatmulBackward(dnarrow_, dweight(layout::kFcw), dweight(layout::kFcb), dfch, a.ln2,
                       Param(stage, layout::kFcw), BT, C, 4 * C);
  // LayerNorm's backward adds into dinp, so dresidual_ becomes
  // d loss / d residual2 (the skip path plus the MLP path).
  ops_->LayerNormBackward(dresidual_, Grad(stage, layout::kLn2w), Grad(stage, layout::kLn2b),
                          dnarrow_, a.residual2, Param(stage, layout::kLn2w), a.ln2_mean,
                          a.ln2_rstd, BT, C);
  // residual2 = residual_in + attproj: the same pass-through as above;
  // LayerNorm's backward has just read residual2 for the last time.
  if (douts != nullptr) std::memcpy(douts->attproj, dresidual_, BT * C * sizeof(float));
  ops_->Zero(dnarrow_, BT * C * sizeof(float));
  ops_->MatmulBackward(dnarrow_, dweight(layout::kAttprojw), dweight(layout::kAttprojb), dresidual_,
                       a.atty, Param(stage, layout::kAttprojw), BT, C, C);
  ops_->Zero(dwide_, BT * 3 * C * sizeof(float));
  ops_->AttentionBackward(dwide_, dpreatt_, dnarrow_, a.qkv, a.att, B, T, C, NH);  // dqkv
  // Attention's backward has read qkv for the last time: dqkv is kept there.
  if (douts != nullptr) std::memcpy(douts->qkv, dwide_, BT * 3 * C * sizeof(float));
  ops_->Zero(dnarrow_, BT * C * sizeof(float));
  ops_->MatmulBackward(dnarrow_, dweight(layout::kQkvw), dweight(layout::kQkvb), dwide_, a.ln1,
                       Param(stage, layout::kQkvw), BT, C, 3 * C);
  ops_->LayerNormBackward(dresidual_, Grad(stage, layout::kLn1w), Grad(stage, layout::kLn1b),
                          dnarrow_, residual_in, Param(stage, layout::kLn1w), a.ln1_mean,
                          a.ln1_rstd, BT, C);
}

void GptModelImpl::PartBackwardWeight(int slot) {
  assert(part_.split_backward);
  Use(slot);
  const int C = config_.dim;
  const size_t BT = static_cast<size_t>(batch_) * time_;
  // What BlockBackward left out, from the same output gradients and
  // inputs: the same sums into the same buffers.
  for (int layer = part_.end_block - 1; layer >= part_.first_block; --layer) {
    const int stage = layout::BlockStage(layer);
    const LayerActivations& a = slot_->layers[layer - part_.first_block];
    const LayerOutputGrads d = OutputGradsIn(a);
    ops_->MatmulBackward(nullptr, Grad(stage, layout::kFcprojw), Grad(stage, layout::kFcprojb),
                         d.fcproj, a.fch_gelu, Param(stage, layout::kFcprojw), BT, 4 * C, C);
    ops_->MatmulBackward(nullptr, Grad(stage, layout::kFcw), Grad(stage, layout::kFcb), d.fch,
                         a.ln2, Param(stage, layout::kFcw), BT, C, 4 * C);
    ops_->MatmulBackward(nullptr, Grad(stage, layout::kAttprojw), Grad(stage, layout::kAttprojb),
                         d.attproj, a.atty, Param(stage, layout::kAttprojw), BT, C, C);
    ops_->MatmulBackward(nullptr, Grad(stage, layout::kQkvw), Grad(stage, layout::kQkvb), d.qkv,
                         a.ln1, Param(stage, layout::kQkvw), BT, C, 3 * C);
  }
}

void GptModelImpl::Backward(int slot, float loss_scale, const float* grad_out, float* grad_in,
                            bool defer_weights) {
  Use(slot);
  Slot& s = *slot_;
  const int B = batch_, T = time_, C = config_.dim, V = config_.vocab;
  const int Vp = config_.padded_vocab();
  const size_t BT = static_cast<size_t>(B) * T;
  const int head = layout::HeadStage(config_);

  if (last_part()) {
    assert(s.has_targets);
    // loss = mean over BT rows, scaled: each row's loss has gradient
    // loss_scale / BT.
    const float dloss = loss_scale / static_cast<float>(BT);
    PreBackward(head);
    ops_->CrossEntropyBackward(dlogits_, s.logits, s.lse, s.targets, dloss, BT, V, Vp);
    // dwte gets the head's share here (padded columns of dlogits are zero,
    // so wte's padded rows get none) and the encoder's share last.
    ops_->Zero(dnarrow_, BT * C * sizeof(float));
    ops_->MatmulBackward(dnarrow_, Grad(0, layout::kWte), nullptr, dlogits_, s.lnf,
                         Param(0, layout::kWte), BT, C, Vp);
    ops_->Zero(dresidual_, BT * C * sizeof(float));
    ops_->LayerNormBackward(dresidual_, Grad(head, layout::kLnfw), Grad(head, layout::kLnfb),
                            dnarrow_, BlockInput(part_.end_block), Param(head, layout::kLnfw),
                            s.lnf_mean, s.lnf_rstd, BT, C);
    PostBackward(head);
  } else {
    ops_->ToDevice(dresidual_, grad_out, BT * C * sizeof(float));
  }

  for (int layer = part_.end_block - 1; layer >= part_.first_block; --layer) {
    PreBackward(layout::BlockStage(layer));
    const LayerOutputGrads douts = OutputGradsIn(s.layers[layer - part_.first_block]);
    BlockBackward(layer, BlockInput(layer), defer_weights ? &douts : nullptr);
    PostBackward(layout::BlockStage(layer));
  }

  if (!first_part()) {
    ops_->ToHost(grad_in, dresidual_, BT * C * sizeof(float));
    return;
  }
  PreBackward(0);
  ops_->EncoderBackward(Grad(0, layout::kWte), Grad(0, layout::kWpe), dresidual_, s.inputs, B, T,
                        C);
  PostBackward(0);
}

// The arguments Create and CreatePart share.
absl::Status CheckModelArgs(const ModelConfig& config, int max_batch, Device device,
                            Precision precision, Attention attention = Attention::kMuster) {
  if (config.layers < 1 || config.dim < 1 || config.heads < 1 || config.dim % config.heads != 0 ||
      config.vocab < 1 || config.seq_len < 1) {
    return absl::InvalidArgumentError(
        "model: layers, heads, dim, vocab and seq_len must be positive, and heads must "
        "divide dim");
  }
  if (max_batch < 1) return absl::InvalidArgumentError("model: max_batch must be positive");
  if (device == Device::kCpu && precision != Precision::kFp32) {
    return absl::InvalidArgumentError(absl::StrCat("precision: ", PrecisionName(precision),
                                                   " needs device cuda; the CPU computes in "
                                                   "fp32 only"));
  }
  // The same words as ResolveAttention's; the head size is the CUDA
  // engine's to check (CreateCudaModel), against cuDNN's own rule.
  if (attention != Attention::kMuster) {
    absl::StatusOr<Attention> resolved =
        ResolveAttention(AttentionName(attention), device, precision);
    if (!resolved.ok()) return resolved.status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GptModel>> GptModel::Create(const ModelConfig& config, int max_batch,
                                                           Device device, Precision precision,
                                                           ParamStorage storage,
                                                           Attention attention) {
  if (absl::Status checked = CheckModelArgs(config, max_batch, device, precision, attention);
      !checked.ok()) {
    return checked;
  }
  if (device == Device::kCuda) {
    return CreateCudaModel(config, max_batch, precision, storage, attention);
  }
  absl::StatusOr<std::unique_ptr<Ops>> ops = MakeOps(device);
  if (!ops.ok()) return ops.status();
  auto model = std::make_unique<GptModelImpl>(config, max_batch, device, std::move(*ops), storage,
                                              ModelPart{0, config.layers, 1});
  if (absl::Status allocated = model->Allocate(); !allocated.ok()) return allocated;
  return std::unique_ptr<GptModel>(std::move(model));
}

absl::StatusOr<std::unique_ptr<GptModel>> GptModel::CreatePart(const ModelConfig& config,
                                                               int max_batch, Device device,
                                                               const ModelPart& part,
                                                               ParamStorage storage) {
  if (part.first_block < 0 || part.end_block > config.layers ||
      part.first_block >= part.end_block || part.slots < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model part: blocks [", part.first_block, ", ", part.end_block, ") of ", config.layers,
        " with ", part.slots, " slots; expected a non-empty range of blocks and 1 or more slots"));
  }
  if (device != Device::kCpu) {
    return absl::UnimplementedError("model parts (pipeline stages) run on the CPU only for now");
  }
  if (absl::Status checked = CheckModelArgs(config, max_batch, device, Precision::kFp32);
      !checked.ok()) {
    return checked;
  }
  absl::StatusOr<std::unique_ptr<Ops>> ops = MakeOps(device);
  if (!ops.ok()) return ops.status();
  auto model =
      std::make_unique<GptModelImpl>(config, max_batch, device, std::move(*ops), storage, part);
  if (absl::Status allocated = model->Allocate(); !allocated.ok()) return allocated;
  return std::unique_ptr<GptModel>(std::move(model));
}

}  // namespace muster::worker
