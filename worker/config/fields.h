// train.yaml's field tables (private to //worker/config): every field is
// one row, and reading, writing, equality, path resolution and
// ConfigFields() all go through the rows (walk.h).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"
#include "worker/config/config.h"

namespace muster::worker::config_detail {

// ---- The field tables
//
// Why tables: so that adding a field touches one place. A field is one row (its yaml key, its
// member, what it means, the checks of its own value), and the reader, ConfigToYaml,
// operator==, the path resolution and ConfigFields() all walk the rows, so none of them can
// miss a field or disagree with another about it. tests/worker/config_test.cc checks the rows
// against the structs' members and docs/yaml-schema.md's tables against ConfigFields(). By
// hand: the checks across fields (Validate), and ModelConfigHash, whose fields checkpoints fix.

// Which strings name files: these resolve against the yaml file's directory.
enum class PathKind { kNone, kGlob, kPath };

// What a value must be beyond its type, checked once the whole file is read.
struct Rule {
  enum class Bound { kNone, kPositive, kNonNegative, kFraction /* [0, 1) */ };
  Bound bound = Bound::kNone;
  int64_t at_most = 0;  // > 0: the largest value allowed, and why
  absl::string_view at_most_why;
  double at_least = 0;  // > 0: the smallest value allowed, and why
  absl::string_view at_least_why;
  // The value is used as a 32-bit float (the optimizer's): it must not
  // round to 0 (unless it is 0), to 1 (a fraction) or to infinity.
  bool fp32 = false;
  absl::string_view words;        // a string's allowed words, "cosine|constant"; empty: any
  absl::string_view or_else;      // what else the string may be, any non-empty one
  absl::string_view noun, nouns;  // "unknown strategy 'x'; known strategies: ..."
  absl::string_view required;     // set: the field has no default, and this is what it is
  PathKind path = PathKind::kNone;

  constexpr Rule AtMost(int64_t max, absl::string_view why) const {
    Rule rule = *this;
    rule.at_most = max;
    rule.at_most_why = why;
    return rule;
  }
  constexpr Rule AtLeast(double min, absl::string_view why) const {
    Rule rule = *this;
    rule.at_least = min;
    rule.at_least_why = why;
    return rule;
  }
  constexpr Rule Fp32() const {
    Rule rule = *this;
    rule.fp32 = true;
    return rule;
  }
  constexpr Rule OneOf(absl::string_view allowed) const {
    Rule rule = *this;
    rule.words = allowed;
    return rule;
  }
  constexpr Rule OrElse(absl::string_view what) const {
    Rule rule = *this;
    rule.or_else = what;
    return rule;
  }
  constexpr Rule Named(absl::string_view singular, absl::string_view plural) const {
    Rule rule = *this;
    rule.noun = singular;
    rule.nouns = plural;
    return rule;
  }
  constexpr Rule Required(absl::string_view what) const {
    Rule rule = *this;
    rule.required = what;
    return rule;
  }
  constexpr Rule Resolved(PathKind kind) const {
    Rule rule = *this;
    rule.path = kind;
    return rule;
  }
};

constexpr Rule WithBound(Rule::Bound bound) {
  Rule rule;
  rule.bound = bound;
  return rule;
}
constexpr Rule Positive() { return WithBound(Rule::Bound::kPositive); }
constexpr Rule NonNegative() { return WithBound(Rule::Bound::kNonNegative); }
constexpr Rule Fraction() { return WithBound(Rule::Bound::kFraction); }
constexpr Rule OneOf(absl::string_view words) { return Rule().OneOf(words); }
constexpr Rule Glob() { return Rule().Resolved(PathKind::kGlob); }
constexpr Rule Path() { return Rule().Resolved(PathKind::kPath); }

// Where a field lives in struct S: a scalar (or a list of integers, which reads, writes and
// compares as one value), or (at the top level only, which keeps the recursion over sections
// finite) a section with a table of its own.
template <typename S>
using ScalarMember = std::variant<int S::*, uint64_t S::*, double S::*, bool S::*, std::string S::*,
                                  std::vector<int> S::*>;
using TopMember =
    std::variant<std::string TrainConfig::*, ModelConfig TrainConfig::*, DataConfig TrainConfig::*,
                 OptimConfig TrainConfig::*, TrainLoopConfig TrainConfig::*,
                 ParallelConfig TrainConfig::*, CheckpointConfig TrainConfig::*>;
template <typename S>
using Member = std::conditional_t<std::is_same_v<S, TrainConfig>, TopMember, ScalarMember<S>>;

template <typename S>
struct Field {
  absl::string_view key;
  Member<S> member;
  absl::string_view doc;
  Rule rule = {};
};

// The fields of each struct, in the order of the file (ConfigToYaml) and of "known keys".
template <typename S>
struct Table;

template <>
struct Table<ModelConfig> {
  using M = ModelConfig;
  static constexpr Field<M> kFields[] = {
      {"layers", &M::layers, "L, transformer blocks", Positive()},
      {"heads", &M::heads, "NH, attention heads; divides dim", Positive()},
      {"dim", &M::dim, "C, the embedding width", Positive()},
      {"vocab", &M::vocab, "V; padded to a multiple of 128 (Vp) in memory",
       Positive().AtMost(65536, "the most that uint16 token ids can address")},
      {"seq_len", &M::seq_len, "T, the longest context", Positive()},
  };
};

template <>
struct Table<DataConfig> {
  using D = DataConfig;
  static constexpr Field<D> kFields[] = {
      {"train", &D::train, "llm.c token shards, matched in sorted order",
       Glob().Required("a glob of token shards (llm.c format)")},
      {"val", &D::val, "validation shards; empty: no validation", Glob()},
      {"micro_batch", &D::micro_batch, "B, sequences per rank per micro-step", Positive()},
      {"grad_accumulation", &D::grad_accumulation, "micro-steps per optimizer step", Positive()},
  };
};

template <>
struct Table<OptimConfig> {
  using O = OptimConfig;
  static constexpr Field<O> kFields[] = {
      {"lr", &O::lr, "the peak learning rate", Positive().Fp32()},
      {"warmup_steps", &O::warmup_steps, "linear warmup to lr", NonNegative()},
      {"schedule", &O::schedule, "cosine decays to min_lr at the last step",
       OneOf("cosine|constant")},
      {"min_lr", &O::min_lr, "where cosine decays to; at most lr", NonNegative().Fp32()},
      {"weight_decay", &O::weight_decay, "decoupled; not on biases, LayerNorm or wpe",
       NonNegative().Fp32()},
      {"beta1", &O::beta1, "AdamW's first-moment decay", Fraction().Fp32()},
      {"beta2", &O::beta2, "AdamW's second-moment decay", Fraction().Fp32()},
      {"eps", &O::eps, "AdamW's epsilon", Positive().Fp32()},
      {"grad_clip", &O::grad_clip, "global-norm clip; 0 disables", NonNegative().Fp32()},
  };
};

template <>
struct Table<TrainLoopConfig> {
  using T = TrainLoopConfig;
  static constexpr Field<T> kFields[] = {
      {"steps", &T::steps, "optimizer steps", Positive()},
      {"seed", &T::seed, "initial weights and the data order"},
      {"log_every", &T::log_every, "steps between log lines", Positive()},
      {"eval_every", &T::eval_every, "steps between validation passes; 0: none", NonNegative()},
      {"eval_batches", &T::eval_batches, "micro-batches per validation pass", Positive()},
      {"metrics_file", &T::metrics_file, "JSONL of per-step metrics; empty: none", Path()},
      {"cuda_graphs", &T::cuda_graphs,
       "CUDA: replay the model's passes as CUDA graphs once captured; auto: on where the "
       "device is cuda; true needs device cuda",
       OneOf("auto|true|false")},
  };
};

template <>
struct Table<ParallelConfig> {
  using P = ParallelConfig;
  static constexpr Field<P> kFields[] = {
      {"strategy", &P::strategy,
       "ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer state "
       "sharded over parallel.dp_shard ranks",
       OneOf("ddp|fsdp").Named("strategy", "strategies")},
      {"zero", &P::zero,
       "the ZeRO stage under fsdp: 1 shards the optimizer moments, 2 also the gradients, 3 also "
       "the parameters",
       Positive().AtMost(3, "the ZeRO stages are 1, 2 and 3")},
      {"reshard_after_forward", &P::reshard_after_forward,
       "ZeRO-3 frees a stage's gathered parameters after its forward and gathers them again for "
       "backward; false keeps them until backward"},
      {"gather_dtype", &P::gather_dtype,
       "the type fsdp all-gathers parameters in; bf16 halves the bytes and rounds every "
       "parameter the model reads to bf16 (the fp32 master copy stays); auto: bf16 when "
       "precision is bf16, else fp32",
       OneOf("auto|fp32|bf16")},
      {"backend", &P::backend, "where gradients are reduced; auto: NCCL on CUDA, Gloo on the CPU",
       OneOf("auto|nccl|gloo")},
      {"bucket_mb", &P::bucket_mb, "gradient all-reduce bucket, MiB", Positive()},
      {"timeout_s", &P::timeout_s, "bound on joining the peers and on every collective",
       Positive()
           .AtLeast(0.01, "a bound that healthy collectives would miss")
           .AtMost(1000000, "about 11.6 days; a longer bound is none")},
      {"dp_replicate", &P::dp_replicate,
       "replicas of the model; 0: the rest of the world, world / (dp_shard x pp)", NonNegative()},
      {"dp_shard", &P::dp_shard,
       "ranks a replica is sharded over; 0: auto, 1 under ddp and world / (dp_replicate x pp) "
       "under fsdp",
       NonNegative()},
      {"pp", &P::pp, "pipeline ranks; the stages' dp ranks replicate (ddp) or shard (fsdp)",
       Positive()},
      {"schedule", &P::schedule, "the pipeline schedule under pp > 1",
       OneOf("gpipe|1f1b|interleaved_1f1b|zb_h1").Named("schedule", "schedules")},
      {"microbatches", &P::microbatches,
       "micro-batches per step under pp > 1; 0: data.grad_accumulation", NonNegative()},
      {"virtual_stages", &P::virtual_stages,
       "pipeline stages per rank under interleaved_1f1b (2 or more); 0: auto (2 there, else 1)",
       NonNegative()},
      {"pp_split", &P::pp_split,
       "blocks per pipeline stage (pp x virtual_stages of them) under pp > 1, summing to "
       "model.layers; empty: balanced"},
  };
};

template <>
struct Table<CheckpointConfig> {
  using C = CheckpointConfig;
  static constexpr Field<C> kFields[] = {
      {"dir", &C::dir, "empty: no checkpoints", Path()},
      {"every", &C::every, "steps between saves; 0: never", NonNegative()},
      {"keep_last", &C::keep_last, "newest checkpoints kept", NonNegative()},
      {"keep_every", &C::keep_every, "also keep steps that are multiples of this; 0: none",
       NonNegative()},
      {"resume", &C::resume, "auto: the newest checkpoint in dir that verifies",
       Path().OneOf("auto|never").OrElse("a checkpoint path")},
      {"lock_wait", &C::lock_wait,
       "seconds to wait for dir's LOCK while a run on another host holds it; 0: refuse at once",
       NonNegative()},
  };
};

// `source` is not here: it is where the config came from, not a yaml field (ConfigToYaml
// writes it as a comment; operator== compares it).
template <>
struct Table<TrainConfig> {
  using T = TrainConfig;
  static constexpr Field<T> kFields[] = {
      {"model", &T::model, "the network's shape"},
      {"data", &T::data, "token shards in llm.c's format"},
      {"optim", &T::optim, "AdamW and the learning-rate schedule"},
      {"train", &T::train, "the loop"},
      {"device", &T::device, "auto: CUDA when the build has it and a GPU is present",
       OneOf("cpu|cuda|auto")},
      {"precision", &T::precision, "auto: bf16 on CUDA, fp32 on the CPU",
       OneOf("auto|fp32|tf32|bf16")},
      {"attention", &T::attention,
       "the CUDA model's attention kernels; auto: cuDNN's in bf16 where libcudnn.so.9 loads, "
       "else muster's; muster: muster's own (flash attention where the precision and shape "
       "allow); gemm: muster's GEMM attention everywhere (cuda); cudnn: cuDNN's fused attention "
       "(cuda, bf16)",
       OneOf("auto|muster|gemm|cudnn")},
      {"parallel", &T::parallel, "how ranks share the work"},
      {"checkpoint", &T::checkpoint, "saving and resuming"},
  };
};

}  // namespace muster::worker::config_detail
