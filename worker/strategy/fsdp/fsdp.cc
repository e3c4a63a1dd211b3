#include "worker/strategy/fsdp/fsdp.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/model/ops.h"

namespace muster::worker {

// Memory of the model's back end, freed through it: persistent (Ops::Alloc,
// zeroed) or transient (Ops::AllocTransient, uninitialised). It holds the
// back end, so it may outlive the model (the strategy is destroyed after
// the trainer).
class Fsdp::Buffer {
 public:
  static absl::StatusOr<std::unique_ptr<Buffer>> Make(std::shared_ptr<Ops> ops, size_t bytes,
                                                      bool transient) {
    absl::StatusOr<void*> ptr = transient ? ops->AllocTransient(bytes) : ops->Alloc(bytes);
    if (!ptr.ok()) return ptr.status();
    return std::unique_ptr<Buffer>(new Buffer(std::move(ops), *ptr, transient));
  }
  ~Buffer() { transient_ ? ops_->FreeTransient(ptr_) : ops_->Free(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* floats() const { return static_cast<float*>(ptr_); }
  uint16_t* halves() const { return static_cast<uint16_t*>(ptr_); }

 private:
  Buffer(std::shared_ptr<Ops> ops, void* ptr, bool transient)
      : ops_(std::move(ops)), ptr_(ptr), transient_(transient) {}
  std::shared_ptr<Ops> ops_;
  void* ptr_;
  bool transient_;
};

// One stage as this rank shards it. `params` and `grads` are the full
// buffers the model reads and adds into while they are bound: slices of
// the kept full copies (ZeRO-1/2), or buffers of their own (`own_*`) that
// the hooks allocate and free.
struct Fsdp::StageShard {
  size_t size = 0;             // floats in the stage
  std::vector<size_t> counts;  // EvenCounts(size, shard ranks)
  size_t first = 0;            // this rank's slice: [first, first + count) of the stage
  size_t count = 0;
  size_t at = 0;  // where the slice lives in shard_params_ / shard_grads_
  float* params = nullptr;
  float* grads = nullptr;
  uint16_t* bf16 = nullptr;  // the bf16 copy of params (kBf16)
  std::unique_ptr<Buffer> own_params, own_grads, own_bf16;
  std::shared_ptr<parallel::Work> gather;  // in flight into `params`
};

// A reduce-scatter of one stage's full gradient in flight: into the shard
// directly, or into `scratch` to be added to it (later micro-steps).
struct Fsdp::PendingReduce {
  int stage = 0;
  std::shared_ptr<parallel::Work> work;
  std::unique_ptr<Buffer> scratch;  // count floats, or null
  std::unique_ptr<Buffer> grads;    // the full gradient it reads, freed after
};

namespace {

// Waits for `work`, adding the time spent to *seconds.
absl::Status TimedWait(parallel::Work& work, double* seconds) {
  const absl::Time start = absl::Now();
  absl::Status status = work.Wait();
  *seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return status;
}

}  // namespace

FsdpMemory FsdpMemoryFormula(int zero, uint64_t owned, uint64_t total, bool bf16,
                             bool gather_bf16) {
  FsdpMemory memory;
  memory.params = 4 * owned + (gather_bf16 ? 2 * owned : 0) +
                  (zero <= 2 ? (bf16 || gather_bf16 ? 6 : 4) * total : 0);
  memory.grads = 4 * owned + (zero == 1 ? 4 * total : 0);
  memory.moments = 8 * owned;
  return memory;
}

Fsdp::Fsdp(parallel::ProcessGroup* shard, parallel::ProcessGroup* replicate,
           parallel::ProcessGroup* control, const parallel::ParallelDims& dims,
           const FsdpOptions& options, std::string backend)
    : shard_(shard),
      replicate_(replicate),
      control_(control),
      dims_(dims),
      options_(options),
      backend_(std::move(backend)) {}

// The model's hooks point here, but the model is destroyed first (the
// trainer goes before the strategy) and never runs after: nothing to undo.
Fsdp::~Fsdp() {
  for (PendingReduce& reduce : reduces_) (void)reduce.work->Wait();
  for (StageShard& stage : stages_) {
    if (stage.gather != nullptr) (void)stage.gather->Wait();
  }
}

std::string Fsdp::Describe() const {
  std::string text =
      absl::StrCat("fsdp (zero-", options_.zero, gather_bf16_ ? ", bf16 gathers" : "", ") over ",
                   backend_, ", ", dims_.world(), " ranks");
  if (dims_.dp_replicate > 1) {
    absl::StrAppend(&text, ": ", dims_.dp_replicate, " replicas x ", dims_.dp_shard, " shards");
  }
  return text;
}

uint64_t Fsdp::owned_floats() const { return shard_floats_; }

std::vector<FlatRange> Fsdp::OwnedParamRanges(int shard_rank) const {
  std::vector<FlatRange> ranges;
  uint64_t stage_flat = 0;
  for (const StageShard& stage : stages_) {
    uint64_t first = 0;
    for (int r = 0; r < shard_rank; ++r) first += stage.counts[r];
    ranges.push_back({stage_flat + first, stage.counts[shard_rank]});
    stage_flat += stage.size;
  }
  return ranges;
}

void Fsdp::Fail(const absl::Status& status) {
  if (!status.ok() && error_.ok()) error_ = status;
}

absl::StatusOr<BuiltModel> Fsdp::Build(const BuildSpec& spec) {
  if (model_ != nullptr) return absl::FailedPreconditionError("Fsdp::Build called twice");
  if (options_.zero < 1 || options_.zero > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.zero: expected 1, 2 or 3, got ", options_.zero));
  }
  const parallel::ParallelDims::Coordinates me = dims_.Of(control_.rank());
  if (dims_.pp != 1 || shard_->size() != dims_.dp_shard || shard_->rank() != me.shard ||
      (replicate_ == nullptr) != (dims_.dp_replicate == 1) ||
      (replicate_ != nullptr &&
       (replicate_->size() != dims_.dp_replicate || replicate_->rank() != me.replicate))) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsdp: the process groups do not match the degrees (", dims_.dp_replicate,
                     " x ", dims_.dp_shard, " x ", dims_.pp, "): shard group ", shard_->rank(),
                     " of ", shard_->size()));
  }
  auto made = GptModel::Create(spec.model, spec.micro_batch, spec.device, spec.precision,
                               ParamStorage::kExternal, spec.attention);
  if (!made.ok()) return made.status();
  BuiltModel built;
  built.model = *std::move(made);
  GptModel* model = built.model.get();
  ops_ = model->shared_ops();
  bf16_ = model->precision() == Precision::kBf16;
  gather_bf16_ =
      options_.gather == GatherDtype::kBf16 || (options_.gather == GatherDtype::kAuto && bf16_);

  const int n = shard_->size(), j = shard_->rank();
  std::vector<Stage>& stages = model->stages();
  stages_.resize(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    StageShard& stage = stages_[s];
    stage.size = stages[s].size;
    stage.counts = parallel::EvenCounts(stage.size, n);
    for (int r = 0; r < j; ++r) stage.first += stage.counts[r];
    stage.count = stage.counts[j];
    stage.at = shard_floats_;
    shard_floats_ += stage.count;
    total_floats_ += stage.size;
  }

  // The persistent arrays (zeroed); a failure here is an error, not an
  // exit.
  auto persistent = [this](size_t bytes, uint64_t* account,
                           std::unique_ptr<Buffer>* into) -> absl::Status {
    auto buffer = Buffer::Make(ops_, bytes, /*transient=*/false);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("fsdp: cannot allocate ", bytes, " bytes: ", buffer.status().message()));
    }
    *into = *std::move(buffer);
    *account += bytes;
    return absl::OkStatus();
  };
  const size_t f = sizeof(float);
  absl::Status status = persistent(shard_floats_ * f, &memory_.params, &shard_params_storage_);
  if (status.ok()) status = persistent(shard_floats_ * f, &memory_.grads, &shard_grads_storage_);
  if (status.ok() && gather_bf16_) {
    status = persistent(shard_floats_ * sizeof(uint16_t), &memory_.params, &shard_bf16_storage_);
  }
  if (status.ok() && options_.zero <= 2) {
    status = persistent(total_floats_ * f, &memory_.params, &full_params_storage_);
    if (status.ok() && (bf16_ || gather_bf16_)) {
      status = persistent(total_floats_ * sizeof(uint16_t), &memory_.params, &full_bf16_storage_);
    }
  }
  if (status.ok() && options_.zero == 1) {
    status = persistent(total_floats_ * f, &memory_.grads, &full_grads_storage_);
  }
  if (!status.ok()) return status;
  shard_params_ = shard_params_storage_->floats();
  shard_grads_ = shard_grads_storage_->floats();
  if (shard_bf16_storage_ != nullptr) shard_bf16_ = shard_bf16_storage_->halves();
  if (full_params_storage_ != nullptr) full_params_ = full_params_storage_->floats();
  if (full_grads_storage_ != nullptr) full_grads_ = full_grads_storage_->floats();
  if (full_bf16_storage_ != nullptr) full_bf16_ = full_bf16_storage_->halves();

  // Every rank computes the same initial weights from the seed, one stage
  // at a time on the host, and keeps its slice (and the whole under
  // ZeRO-1/2): nothing to communicate, and never more than one stage
  // beyond the shard.
  model_ = model;  // for BindModel; the hooks are set below
  std::vector<float> initial;
  size_t stage_flat = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    StageShard& stage = stages_[s];
    initial.resize(stage.size);
    model->InitStageWeights(static_cast<int>(s), spec.seed, initial.data());
    ops_->ToDevice(shard_params_ + stage.at, initial.data() + stage.first,
                   stage.count * sizeof(float));
    if (full_params_ != nullptr) {
      stage.params = full_params_ + stage_flat;
      ops_->ToDevice(stage.params, initial.data(), stage.size * sizeof(float));
      if (full_bf16_ != nullptr) {
        stage.bf16 = full_bf16_ + stage_flat;
        // Bf16 gathers: round the kept copy as a gather would.
        if (gather_bf16_) ops_->CastToBf16(stage.bf16, stage.params, stage.size);
        FinishGather(static_cast<int>(s));
      }
    }
    if (full_grads_ != nullptr) stage.grads = full_grads_ + stage_flat;
    BindModel(static_cast<int>(s));
    stage_flat += stage.size;
  }
  initial = {};
  if (gather_bf16_) ops_->CastToBf16(shard_bf16_, shard_params_, shard_floats_);

  // One AdamW group per stage, so OptimizerStep can send a stage's new
  // parameters while the next stage updates.
  ParamShard shard;
  for (size_t s = 0; s < stages_.size(); ++s) {
    ParamShard::Group group;
    group.params = shard_params_ + stages_[s].at;
    group.grads = shard_grads_ + stages_[s].at;
    // Bf16 gathers send this copy; AdamW refreshes it in the same pass.
    group.bf16 = gather_bf16_ ? shard_bf16_ + stages_[s].at : nullptr;
    group.slices.push_back({static_cast<int>(s), stages_[s].first, stages_[s].count, 0});
    shard.groups.push_back(std::move(group));
  }
  auto optimizer = AdamW::Create(model, spec.optim, std::move(shard));
  if (!optimizer.ok()) {
    model_ = nullptr;
    return optimizer.status();
  }
  built.optimizer = *std::move(optimizer);
  memory_.moments = 2 * built.optimizer->moment_floats() * sizeof(float);

  GptModel::StageHooks hooks;
  hooks.pre_forward = [this](int s) { PreForward(s); };
  hooks.post_forward = [this](int s) { PostForward(s); };
  hooks.pre_backward = [this](int s) { PreBackward(s); };
  hooks.post_backward = [this](int s) { PostBackward(s); };
  model->SetStageHooks(std::move(hooks));
  model_ = model;
  return built;
}

std::vector<int> Fsdp::ParamsNeeded(int stage) const {
  const int head = static_cast<int>(stages_.size()) - 1;
  if (stage == head) return {head, 0};  // the LM head is wte, tied
  return {stage};
}

std::unique_ptr<Fsdp::Buffer> Fsdp::TransientOrExit(size_t bytes, const char* what, int stage) {
  auto buffer = Buffer::Make(ops_, bytes, /*transient=*/true);
  if (!buffer.ok()) {
    // A hook cannot return an error; the issue asks an OOM to be a clear
    // exit naming the bytes.
    std::fprintf(stderr, "worker: fsdp: out of memory for stage %d's %s (%zu bytes): %s\n", stage,
                 what, bytes, std::string(buffer.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(buffer);
}

void Fsdp::FinishGather(int s) {
  StageShard& stage = stages_[s];
  if (gather_bf16_) {
    ops_->CastFromBf16(stage.params, stage.bf16, stage.size);
    if (!bf16_ && stage.own_bf16 != nullptr) {
      // Only the receive buffer: the model reads fp32. Stream ordered on
      // CUDA, so freed after the widening.
      stage.own_bf16.reset();
      stage.bf16 = nullptr;
      memory_.gathered -= stage.size * sizeof(uint16_t);
    }
  } else if (bf16_) {
    ops_->CastToBf16(stage.bf16, stage.params, stage.size);
  }
}

uint16_t* Fsdp::ModelBf16(int s) const { return bf16_ ? stages_[s].bf16 : nullptr; }

void Fsdp::BindModel(int s) {
  const StageShard& stage = stages_[s];
  model_->BindStage(s, stage.params, stage.grads, ModelBf16(s));
}

void Fsdp::StartGather(int s) {
  StageShard& stage = stages_[s];
  if (stage.params != nullptr) return;  // kept, gathered or on its way
  stage.own_params = TransientOrExit(stage.size * sizeof(float), "gathered parameters", s);
  stage.params = stage.own_params->floats();
  memory_.gathered += stage.size * sizeof(float);
  if (bf16_ || gather_bf16_) {  // the model's copy, or where bf16 gathers land
    stage.own_bf16 = TransientOrExit(stage.size * sizeof(uint16_t), "bf16 parameters", s);
    stage.bf16 = stage.own_bf16->halves();
    memory_.gathered += stage.size * sizeof(uint16_t);
  }
  memory_.gathered_peak = std::max(memory_.gathered_peak, memory_.gathered);
  stage.gather = IssueGather(s);
}

std::shared_ptr<parallel::Work> Fsdp::IssueGather(int s) {
  StageShard& stage = stages_[s];
  ++waits_.gathers;
  if (gather_bf16_) {
    return shard_->AllGatherBf16(absl::MakeConstSpan(shard_bf16_ + stage.at, stage.count),
                                 absl::MakeSpan(stage.bf16, stage.size), stage.counts);
  }
  return shard_->AllGather(absl::MakeConstSpan(shard_params_ + stage.at, stage.count),
                           absl::MakeSpan(stage.params, stage.size), stage.counts);
}

void Fsdp::WaitGathered(int s) {
  StageShard& stage = stages_[s];
  if (stage.gather != nullptr) {
    Fail(TimedWait(*stage.gather, &waits_.gather_s));
    stage.gather = nullptr;
    // On the compute stream, after the gather (waited for above).
    FinishGather(s);
  }
  BindModel(s);
}

void Fsdp::ReleaseParams(int s) {
  StageShard& stage = stages_[s];
  if (stage.own_params == nullptr) return;  // kept (ZeRO-1/2) or not gathered
  if (stage.gather != nullptr) {
    Fail(stage.gather->Wait());  // the group still writes into it
    stage.gather = nullptr;
  }
  // Transient: on CUDA freed after the stage's queued kernels.
  stage.own_params.reset();
  stage.params = nullptr;
  memory_.gathered -= stage.size * sizeof(float);
  if (stage.own_bf16 != nullptr) {
    stage.own_bf16.reset();
    stage.bf16 = nullptr;
    memory_.gathered -= stage.size * sizeof(uint16_t);
  }
  model_->BindStage(s, nullptr, stage.grads, nullptr);
}

absl::Status Fsdp::GatherAll() {
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (size_t s = 0; s < stages_.size(); ++s) works.push_back(IssueGather(static_cast<int>(s)));
  for (auto& work : works) Fail(TimedWait(*work, &waits_.gather_s));
  for (size_t s = 0; s < stages_.size(); ++s) FinishGather(static_cast<int>(s));
  return error_;
}

void Fsdp::BindGrads(int s) {
  StageShard& stage = stages_[s];
  if (stage.grads != nullptr) return;  // kept (ZeRO-1) or bound earlier in this backward
  stage.own_grads = TransientOrExit(stage.size * sizeof(float), "gradient", s);
  stage.grads = stage.own_grads->floats();
  ops_->Zero(stage.grads, stage.size * sizeof(float));
  memory_.gathered += stage.size * sizeof(float);
  memory_.gathered_peak = std::max(memory_.gathered_peak, memory_.gathered);
  BindModel(s);
}

void Fsdp::StartReduce(int s) {
  StageShard& stage = stages_[s];
  PendingReduce reduce;
  reduce.stage = s;
  float* out = shard_grads_ + stage.at;
  // ZeRO-1 reduces once per step, the sum of every micro-step; ZeRO-2/3
  // reduce each micro-step's and add all but the first into the shard.
  if (options_.zero >= 2 && micro_step_ > 1) {
    reduce.scratch = TransientOrExit(stage.count * sizeof(float), "accumulation scratch", s);
    memory_.gathered += stage.count * sizeof(float);
    memory_.gathered_peak = std::max(memory_.gathered_peak, memory_.gathered);
    out = reduce.scratch->floats();
  }
  reduce.work = shard_->ReduceScatter(absl::MakeConstSpan(stage.grads, stage.size),
                                      absl::MakeSpan(out, stage.count), stage.counts,
                                      parallel::ReduceOp::kAvg);
  if (options_.zero >= 2) {
    // The buffer now belongs to the reduction; the model is done with it.
    reduce.grads = std::move(stage.own_grads);
    stage.grads = nullptr;
    BindModel(s);
  }
  reduces_.push_back(std::move(reduce));
  ++waits_.reduces;
}

absl::Status Fsdp::RetireReduces(bool wait) {
  size_t done = 0;
  for (; done < reduces_.size(); ++done) {
    PendingReduce& reduce = reduces_[done];
    if (!wait && !reduce.work->Done()) break;
    Fail(TimedWait(*reduce.work, &waits_.reduce_s));
    const StageShard& stage = stages_[reduce.stage];
    if (reduce.scratch != nullptr) {
      // into += scratch (ResidualForward allows out to alias an input).
      float* into = shard_grads_ + stage.at;
      ops_->ResidualForward(into, into, reduce.scratch->floats(), stage.count);
      memory_.gathered -= stage.count * sizeof(float);
    }
    if (reduce.grads != nullptr) memory_.gathered -= stage.size * sizeof(float);
  }
  reduces_.erase(reduces_.begin(), reduces_.begin() + done);
  return error_;
}

void Fsdp::PreForward(int s) {
  for (int need : ParamsNeeded(s)) StartGather(need);
  for (int need : ParamsNeeded(s)) WaitGathered(need);
  // Prefetch: the next stage's gather runs while this one computes.
  if (s + 1 < static_cast<int>(stages_.size())) {
    for (int need : ParamsNeeded(s + 1)) StartGather(need);
  }
}

void Fsdp::PostForward(int s) {
  const int head = static_cast<int>(stages_.size()) - 1;
  // The head (and wte with it) is used again at once by backward, and so is
  // the last block, whose backward comes right after the head's: freeing
  // it would only gather it again behind the head's backward, which is all
  // there is to hide that gather (as torchtitan leaves its last block
  // unsharded after forward). Its memory is held during the head's
  // forward, below the head's backward's peak (stage 0's parameters and
  // gradient, and this block on its way).
  if (options_.zero == 3 && options_.reshard_after_forward && s != head && s != head - 1) {
    ReleaseParams(s);
  }
}

void Fsdp::PreBackward(int s) {
  const int head = static_cast<int>(stages_.size()) - 1;
  if (s != 0) {  // the encoder's backward reads no parameters
    for (int need : ParamsNeeded(s)) StartGather(need);
    for (int need : ParamsNeeded(s)) WaitGathered(need);
  }
  BindGrads(s);
  if (s == head) BindGrads(0);  // the head's share of wte's gradient
  const int next = s == head ? head - 1 : s - 1;
  if (next >= 1) {
    for (int need : ParamsNeeded(next)) StartGather(need);
  }
  (void)RetireReduces(/*wait=*/false);  // frees what has finished
}

void Fsdp::PostBackward(int s) {
  const int head = static_cast<int>(stages_.size()) - 1;
  if (options_.zero == 3) {
    ReleaseParams(s);
    if (s == head) ReleaseParams(0);
  }
  if (options_.zero >= 2 || last_micro_step_) StartReduce(s);
}

void Fsdp::BeginBackward(GptModel* model, bool last) {
  ++micro_step_;
  last_micro_step_ = last;
}

absl::Status Fsdp::ReduceGradients(GptModel* model) {
  if (model != model_) {
    return absl::FailedPreconditionError("Fsdp::ReduceGradients on a model Build did not make");
  }
  if (absl::Status retired = RetireReduces(/*wait=*/true); !retired.ok()) return retired;
  if (replicate_ != nullptr) {
    // HSDP: the replicas' shards hold the same slice; average them.
    Fail(TimedWait(*replicate_->AllReduce(absl::MakeSpan(shard_grads_, shard_floats_),
                                          parallel::ReduceOp::kAvg),
                   &waits_.reduce_s));
  }
  return error_;
}

absl::StatusOr<double> Fsdp::GradSumOfSquares(GptModel* model) {
  if (!error_.ok()) return error_;
  const double local = ops_->SumOfSquares(shard_grads_, shard_floats_);
  // Every replica holds the same shards (HSDP): the first replica's once.
  // Summed over the control group, which is host memory whatever the
  // device (the shard group may be NCCL's, which reads only device
  // memory); the other replicas add an exact 0, so the sum is that of the
  // shard ranks in their order, the same bits as over the shard group.
  return control_.SumDouble(dims_.Of(control_.rank()).replicate == 0 ? local : 0.0);
}

absl::Status Fsdp::OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                 float grad_scale) {
  if (!error_.ok()) return error_;
  if (optimizer->groups() != stages_.size()) {
    return absl::FailedPreconditionError("Fsdp::OptimizerStep with an AdamW Build did not make");
  }
  // Stage by stage, each stage's all-gather sent as soon as it has
  // updated, behind the next stages' updates: under ZeRO-1/2 every stage's
  // (into the full copy), waited for at the end; under ZeRO-3 those the
  // next step's forward needs first (the first two stages'), left in
  // flight for it, so only the embedding's own gather is not hidden.
  for (size_t s = 0; s < stages_.size(); ++s) ReleaseParams(static_cast<int>(s));  // ZeRO-3
  std::vector<int> first_needed;
  if (options_.zero == 3) {
    first_needed = ParamsNeeded(0);
    if (stages_.size() > 1) {
      for (int need : ParamsNeeded(1)) first_needed.push_back(need);
    }
  }
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (size_t s = 0; s < stages_.size(); ++s) {
    optimizer->StepGroup(s, lr, step, grad_scale);
    if (options_.zero <= 2) {
      works.push_back(IssueGather(static_cast<int>(s)));
    } else if (std::find(first_needed.begin(), first_needed.end(), static_cast<int>(s)) !=
               first_needed.end()) {
      StartGather(static_cast<int>(s));
    }
  }
  for (size_t s = 0; s < works.size(); ++s) {  // ZeRO-1/2: one per stage
    Fail(TimedWait(*works[s], &waits_.gather_s));
    FinishGather(static_cast<int>(s));
  }
  absl::Status status = error_;
  if (!logged_memory_ && options_.log != nullptr) {
    logged_memory_ = true;
    const FsdpMemory want =
        FsdpMemoryFormula(options_.zero, shard_floats_, total_floats_, bf16_, gather_bf16_);
    std::fprintf(options_.log,
                 "worker: fsdp rank %d memory: params %llu B, grads %llu B, moments %llu B "
                 "(formula %llu + %llu + %llu: %s); gathered buffers peak %llu B\n",
                 control_.rank(), static_cast<unsigned long long>(memory_.params),
                 static_cast<unsigned long long>(memory_.grads),
                 static_cast<unsigned long long>(memory_.moments),
                 static_cast<unsigned long long>(want.params),
                 static_cast<unsigned long long>(want.grads),
                 static_cast<unsigned long long>(want.moments),
                 want.params == memory_.params && want.grads == memory_.grads &&
                         want.moments == memory_.moments
                     ? "equal"
                     : "DIFFERENT",
                 static_cast<unsigned long long>(memory_.gathered_peak));
    std::fflush(options_.log);
  }
  return status;
}

void Fsdp::ZeroGrad(GptModel* model) {
  micro_step_ = 0;
  last_micro_step_ = false;
  // ZeRO-2/3: the first micro-step's reduction overwrites the shard.
  if (full_grads_ != nullptr) ops_->Zero(full_grads_, total_floats_ * sizeof(float));
}

std::vector<std::vector<FlatRange>> Fsdp::CheckpointFiles(uint64_t total) const {
  std::vector<std::vector<FlatRange>> files;
  for (int rank = 0; rank < dims_.world(); ++rank) {
    const parallel::ParallelDims::Coordinates at = dims_.Of(rank);
    const std::vector<FlatRange> state = StateRanges(OwnedParamRanges(at.shard), total);
    // Replicas hold the same shard: each writes its share of it.
    files.push_back(SplitRanges(state, dims_.dp_replicate, at.replicate));
  }
  return files;
}

std::vector<FlatRange> Fsdp::CheckpointLoad(uint64_t total) const {
  return StateRanges(OwnedParamRanges(shard_->rank()), total);
}

absl::Status Fsdp::StateLoaded(GptModel* model) {
  // What bf16 gathers send must be the loaded slice's.
  if (gather_bf16_) ops_->CastToBf16(shard_bf16_, shard_params_, shard_floats_);
  if (options_.zero <= 2) return GatherAll();
  for (size_t s = 0; s < stages_.size(); ++s) ReleaseParams(static_cast<int>(s));
  return error_;
}

absl::StatusOr<uint64_t> Fsdp::ParamsFingerprint() {
  // FNV-1a: a hash that is the same in every process and build, which
  // absl::Hash (seeded per process) is not, and this Abseil (20220623)
  // has no public CRC; five lines are cheaper than a dependency.
  uint64_t hash = 14695981039346656037ull;
  for (size_t s = 0; s < stages_.size(); ++s) {
    absl::StatusOr<std::vector<float>> params = GatheredParams(static_cast<int>(s));
    if (!params.ok()) return params.status();
    const auto* bytes = reinterpret_cast<const unsigned char*>(params->data());
    for (size_t i = 0; i < params->size() * sizeof(float); ++i) {
      hash = (hash ^ bytes[i]) * 1099511628211ull;
    }
  }
  return hash;
}

absl::Status Fsdp::AfterRun(GptModel* model) {
  if (!error_.ok()) return error_;
  absl::StatusOr<uint64_t> fingerprint = ParamsFingerprint();
  if (!fingerprint.ok()) return fingerprint.status();
  if (options_.log != nullptr) {
    std::fprintf(options_.log, "worker: fsdp rank %d parameters: fnv1a64 %016llx\n",
                 control_.rank(), static_cast<unsigned long long>(*fingerprint));
    std::fflush(options_.log);
  }
  return error_;
}

absl::StatusOr<std::vector<float>> Fsdp::GatheredParams(int s) {
  StageShard& stage = stages_[s];
  const bool had = stage.params != nullptr;
  StartGather(s);
  WaitGathered(s);
  if (!error_.ok()) return error_;
  std::vector<float> copy(stage.size);
  ops_->ToHost(copy.data(), stage.params, stage.size * sizeof(float));
  if (!had) ReleaseParams(s);
  return copy;
}

}  // namespace muster::worker
