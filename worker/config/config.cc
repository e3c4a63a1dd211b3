#include "worker/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace muster::worker {
namespace {

// Edit distance, for "did you mean" on an unknown key.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

bool ByLength(const std::string& a, const std::string& b) { return a.size() < b.size(); }

// How a value looks in a message: the scalar itself, or its kind.
std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return absl::StrCat("'", node.Scalar(), "'");
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    default:
      return "nothing";
  }
}

// One line of yaml-cpp's position, 1-based; a null value's mark points past
// it, so callers pass the key's line as the fallback.
int LineOf(const YAML::Node& node, int fallback) {
  if (node.Type() == YAML::NodeType::Null || node.Mark().line < 0) return fallback;
  return node.Mark().line + 1;
}

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
      {"lr", &O::lr, "the peak learning rate", Positive()},
      {"warmup_steps", &O::warmup_steps, "linear warmup to lr", NonNegative()},
      {"schedule", &O::schedule, "cosine decays to min_lr at the last step",
       OneOf("cosine|constant")},
      {"min_lr", &O::min_lr, "where cosine decays to; at most lr", NonNegative()},
      {"weight_decay", &O::weight_decay, "decoupled; not on biases, LayerNorm or wpe",
       NonNegative()},
      {"beta1", &O::beta1, "AdamW's first-moment decay", Fraction()},
      {"beta2", &O::beta2, "AdamW's second-moment decay", Fraction()},
      {"eps", &O::eps, "AdamW's epsilon", Positive()},
      {"grad_clip", &O::grad_clip, "global-norm clip; 0 disables", NonNegative()},
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
      {"backend", &P::backend, "where gradients are reduced; auto: NCCL on CUDA, Gloo on the CPU",
       OneOf("auto|nccl|gloo")},
      {"bucket_mb", &P::bucket_mb, "gradient all-reduce bucket, MiB", Positive()},
      {"timeout_s", &P::timeout_s, "bound on joining the peers and on every collective",
       Positive()},
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
      {"parallel", &T::parallel, "how ranks share the work"},
      {"checkpoint", &T::checkpoint, "saving and resuming"},
  };
};

// ---- Walking the tables

template <typename M>
struct PointeeOf;
template <typename S, typename T>
struct PointeeOf<T S::*> {
  using type = T;
};
template <typename M>
using Pointee = typename PointeeOf<M>::type;
template <typename T>
constexpr bool kIsSection =
    std::is_class_v<T> && !std::is_same_v<T, std::string> && !std::is_same_v<T, std::vector<int>>;

std::vector<std::string> Words(const Rule& rule) {
  if (rule.words.empty()) return {};
  return absl::StrSplit(rule.words, '|');
}
bool IsWord(const Rule& rule, const std::string& value) {
  const std::vector<std::string> words = Words(rule);
  return std::find(words.begin(), words.end(), value) != words.end();
}

// Each scalar type's reader: what was wrong, or nothing.
std::optional<std::string> ReadScalar(const YAML::Node& node, int* out) {
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  int64_t wide;
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), &wide)) {
    return absl::StrCat("expected a 32-bit integer, ", Describe(node), " is out of range");
  }
  return absl::StrCat("expected an integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, uint64_t* out) {
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  return absl::StrCat("expected a non-negative integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, double* out) {
  if (node.IsScalar() && absl::SimpleAtod(node.Scalar(), out) && std::isfinite(*out)) {
    return std::nullopt;
  }
  return absl::StrCat("expected a number, got ", Describe(node));
}
// YAML 1.2's booleans only: yes/no/on/off (YAML 1.1) are refused rather
// than guessed at.
std::optional<std::string> ReadScalar(const YAML::Node& node, bool* out) {
  if (node.IsScalar()) {
    const std::string& text = node.Scalar();
    if (text == "true" || text == "True" || text == "TRUE") {
      *out = true;
      return std::nullopt;
    }
    if (text == "false" || text == "False" || text == "FALSE") {
      *out = false;
      return std::nullopt;
    }
  }
  return absl::StrCat("expected true or false, got ", Describe(node));
}
// A null value (`val:` with nothing after it) reads as the empty string.
std::optional<std::string> ReadScalar(const YAML::Node& node, std::string* out) {
  if (node.IsNull()) {
    out->clear();
    return std::nullopt;
  }
  if (node.IsScalar()) {
    *out = node.Scalar();
    return std::nullopt;
  }
  return absl::StrCat("expected a string, got ", Describe(node));
}

// A flow (`[4, 4]`) or block (`- 4`) sequence of integers; a null value
// (`pp_split:` with nothing after it) reads as the empty list.
std::optional<std::string> ReadScalar(const YAML::Node& node, std::vector<int>* out) {
  if (node.IsNull()) {
    out->clear();
    return std::nullopt;
  }
  if (!node.IsSequence()) return absl::StrCat("expected a list of integers, got ", Describe(node));
  std::vector<int> values;
  for (size_t i = 0; i < node.size(); ++i) {
    const YAML::Node item = node[i];
    int value;
    if (item.IsScalar() && absl::SimpleAtoi(item.Scalar(), &value)) {
      values.push_back(value);
      continue;
    }
    int64_t wide;
    if (item.IsScalar() && absl::SimpleAtoi(item.Scalar(), &wide)) {
      return absl::StrCat("expected a list of 32-bit integers, entry ", i + 1, " ", Describe(item),
                          " is out of range");
    }
    return absl::StrCat("expected a list of integers, got ", Describe(item), " at entry ", i + 1);
  }
  *out = std::move(values);
  return std::nullopt;
}

// The shortest text that reads back as exactly `value`.
std::string ExactDouble(double value) {
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  std::string text(buffer, result.ptr);
  // "1.0", not "1": the field is a number, not an integer, to the reader.
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

// Double-quoted, so a glob starting with '*' is not read as an alias.
std::string Quoted(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char escape[8];
      snprintf(escape, sizeof(escape), "\\x%02x", static_cast<unsigned char>(ch));
      out += escape;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// Each scalar type's writer: text the reader reads back as exactly the value.
std::string WriteScalar(int value) { return absl::StrCat(value); }
std::string WriteScalar(uint64_t value) { return absl::StrCat(value); }
std::string WriteScalar(double value) { return ExactDouble(value); }
std::string WriteScalar(bool value) { return value ? "true" : "false"; }
std::string WriteScalar(const std::string& value) { return Quoted(value); }
std::string WriteScalar(const std::vector<int>& value) {
  return absl::StrCat("[", absl::StrJoin(value, ", "), "]");
}

template <typename T>
std::string TypeName(const Rule& rule) {
  if constexpr (std::is_same_v<T, double>) {
    return "number";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "boolean";
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return "list of integers";
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (rule.path == PathKind::kGlob) return "string (glob)";
    if (rule.path == PathKind::kPath) return "string (path)";
    return "string";
  } else {
    return "integer";
  }
}

// "a, b or c"
std::string JoinOr(const std::vector<std::string>& items) {
  if (items.size() < 2) return absl::StrJoin(items, "");
  return absl::StrCat(absl::StrJoin(items.begin(), items.end() - 1, ", "), " or ", items.back());
}

// What is wrong with a field's own value, or nothing.
template <typename T>
std::optional<std::string> CheckValue(const Rule& rule, const T& value) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!rule.required.empty() && value.empty()) {
      return absl::StrCat("missing; expected ", rule.required);
    }
    if (rule.words.empty() || IsWord(rule, value)) return std::nullopt;
    if (!rule.or_else.empty() && !value.empty()) return std::nullopt;
    if (!rule.noun.empty()) {
      return absl::StrCat("unknown ", rule.noun, " '", value, "'; known ", rule.nouns, ": ",
                          absl::StrJoin(Words(rule), ", "));
    }
    std::vector<std::string> expected = Words(rule);
    if (!rule.or_else.empty()) expected.emplace_back(rule.or_else);
    return absl::StrCat("expected ", JoinOr(expected), ", got '", value, "'");
  } else if constexpr (std::is_same_v<T, bool>) {
    return std::nullopt;  // both values are possible; the reader checked the type
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return std::nullopt;  // parallel.pp_split: its checks involve other fields (Validate)
  } else {
    const double number = static_cast<double>(value);
    switch (rule.bound) {
      case Rule::Bound::kNone:
        break;
      case Rule::Bound::kPositive:
        if (!(number > 0)) return absl::StrCat("must be > 0, got ", number);
        break;
      case Rule::Bound::kNonNegative:
        if (!(number >= 0)) return absl::StrCat("must be >= 0, got ", number);
        break;
      case Rule::Bound::kFraction:
        if (number < 0 || number >= 1) {
          return absl::StrCat("expected a value in [0, 1), got ", number);
        }
        break;
    }
    if (rule.at_most > 0 && number > static_cast<double>(rule.at_most)) {
      return absl::StrCat(value, " is more than ", rule.at_most, ", ", rule.at_most_why);
    }
    return std::nullopt;
  }
}

template <typename S>
void WriteYaml(const S& config, const std::string& indent, std::string* out) {
  for (const Field<S>& field : Table<S>::kFields) {
    std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            absl::StrAppend(out, indent, field.key, ":\n");
            WriteYaml(config.*member, indent + "  ", out);
          } else {
            absl::StrAppend(out, indent, field.key, ": ", WriteScalar(config.*member), "\n");
          }
        },
        field.member);
  }
}

template <typename S>
bool Equal(const S& a, const S& b) {
  for (const Field<S>& field : Table<S>::kFields) {
    const bool same = std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            return Equal(a.*member, b.*member);
          } else {
            return a.*member == b.*member;
          }
        },
        field.member);
    if (!same) return false;
  }
  return true;
}

// Calls fn(path, rule, value&) for every scalar field of `config`, in table order.
template <typename S, typename Fn>
void ForEachScalar(S& config, const std::string& prefix, const Fn& fn) {
  for (const Field<std::remove_const_t<S>>& field : Table<std::remove_const_t<S>>::kFields) {
    const std::string path = absl::StrCat(prefix, field.key);
    std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            ForEachScalar(config.*member, path + ".", fn);
          } else {
            fn(path, field.rule, config.*member);
          }
        },
        field.member);
  }
}

// ConfigFields() for struct S, reached from a TrainConfig through `access`.
template <typename S, typename Access>
void ListFields(const std::string& prefix, const Access& access, std::vector<ConfigField>* out) {
  static const TrainConfig kDefaults;
  for (const Field<S>& field : Table<S>::kFields) {
    const std::string path = absl::StrCat(prefix, field.key);
    std::visit(
        [&](auto member) {
          using T = Pointee<decltype(member)>;
          if constexpr (kIsSection<T>) {
            auto section = [ access, member ](auto& config) -> auto& {
              return access(config).*member;
            };
            ListFields<T>(path + ".", section, out);
          } else {
            ConfigField listed;
            listed.path = path;
            listed.type = TypeName<T>(field.rule);
            listed.default_text = WriteScalar(access(kDefaults).*member);
            listed.description = std::string(field.doc);
            listed.required = !field.rule.required.empty();
            listed.words = Words(field.rule);
            listed.get = [access, member](const TrainConfig& config) {
              return WriteScalar(access(config).*member);
            };
            listed.set = [access, member, path](const std::string& yaml_value,
                                                TrainConfig* config) {
              YAML::Node node;
              try {
                node = YAML::Load(yaml_value);
              } catch (const YAML::Exception& error) {
                return absl::InvalidArgumentError(
                    absl::StrCat(path, ": invalid yaml: ", error.msg));
              }
              T value;
              if (std::optional<std::string> what = ReadScalar(node, &value)) {
                return absl::InvalidArgumentError(absl::StrCat(path, ": ", *what));
              }
              access(*config).*member = std::move(value);
              return absl::OkStatus();
            };
            out->push_back(std::move(listed));
          }
        },
        field.member);
  }
}

// ---- Reading

// Reads one yaml document into a TrainConfig, remembering each key path's
// line so that checks across fields can point at the file.
class ConfigReader {
 public:
  explicit ConfigReader(std::string name) : name_(std::move(name)) {}

  absl::Status Error(int line, const std::string& path, const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ":", line, ": ", path.empty() ? "" : path + ": ", what));
  }

  // The line of the first of `paths` the file set, else of its section.
  int LineFor(const std::vector<std::string>& paths) const {
    for (const std::string& path : paths) {
      auto it = lines_.find(path);
      if (it != lines_.end()) return it->second;
    }
    for (const std::string& path : paths) {
      auto it = lines_.find(path.substr(0, path.find('.')));
      if (it != lines_.end()) return it->second;
    }
    return 1;
  }

  absl::Status Read(const YAML::Node& root, TrainConfig* config);

 private:
  template <typename S>
  absl::Status ReadMap(const YAML::Node& map, const std::string& prefix, int line, S* out);

  std::string name_;
  std::map<std::string, int> lines_;  // key path -> 1-based line of its value
};

template <typename S>
absl::Status ConfigReader::ReadMap(const YAML::Node& map, const std::string& prefix, int line,
                                   S* out) {
  if (map.IsNull()) return absl::OkStatus();  // an empty section keeps the defaults
  if (!map.IsMap()) {
    return Error(line, prefix, absl::StrCat("expected a map, got ", Describe(map)));
  }
  std::vector<std::string> known;
  for (const Field<S>& field : Table<S>::kFields) known.emplace_back(field.key);
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node key = it->first;
    const int key_line = key.Mark().line + 1;
    if (!key.IsScalar()) {
      return Error(key_line, prefix, absl::StrCat("expected a key, got ", Describe(key)));
    }
    const std::string path = prefix.empty() ? key.Scalar() : prefix + "." + key.Scalar();
    auto [seen, inserted] = lines_.emplace(path, key_line);
    if (!inserted) {
      return Error(key_line, path,
                   absl::StrCat("duplicate key (first set on line ", seen->second, ")"));
    }
    const Field<S>* field = nullptr;
    for (const Field<S>& candidate : Table<S>::kFields) {
      if (candidate.key == key.Scalar()) field = &candidate;
    }
    if (field == nullptr) {
      std::string what = "unknown key";
      const std::string* closest = nullptr;
      const size_t limit = std::max<size_t>(2, key.Scalar().size() / 3);
      size_t best = limit + 1;
      for (const std::string& candidate : known) {
        size_t distance = EditDistance(key.Scalar(), candidate);
        // A key that extends a known one or cuts it short ("optimizer" for
        // "optim") is near whatever its edit distance.
        const std::string& shorter = std::min(key.Scalar(), candidate, ByLength);
        const std::string& longer = std::max(key.Scalar(), candidate, ByLength);
        if (shorter.size() >= 3 && shorter.size() < longer.size() &&
            longer.compare(0, shorter.size(), shorter) == 0) {
          distance = std::min(distance, limit);
        }
        if (distance < best) best = distance, closest = &candidate;
      }
      if (closest) absl::StrAppend(&what, "; did you mean '", *closest, "'?");
      absl::StrAppend(&what, " (known keys", prefix.empty() ? "" : " in " + prefix, ": ",
                      absl::StrJoin(known, ", "), ")");
      return Error(key_line, path, what);
    }
    const YAML::Node value = it->second;
    const int value_line = LineOf(value, key_line);
    absl::Status status = std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            return ReadMap(value, path, value_line, &(out->*member));
          } else {
            std::optional<std::string> what = ReadScalar(value, &(out->*member));
            return what ? Error(value_line, path, *what) : absl::OkStatus();
          }
        },
        field->member);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status ConfigReader::Read(const YAML::Node& root, TrainConfig* config) {
  if (root.IsNull()) {
    return Error(1, "", "empty file; expected a map of sections (model, data, optim, ...)");
  }
  if (!root.IsMap()) {
    return Error(LineOf(root, 1), "",
                 absl::StrCat("expected a map of sections at the top level, got ", Describe(root)));
  }
  return ReadMap(root, "", 1, config);
}

// Every impossible value, checked after reading so that checks across
// fields see the final values whatever order the file wrote them in. Each
// field's own checks come first, in table order (so the checks across
// fields see values that are each possible, heads > 0 among them).
absl::Status Validate(const TrainConfig& config, const ConfigReader& reader) {
  auto fail = [&](const std::string& path, const std::string& what,
                  std::initializer_list<std::string> also = {}) {
    std::vector<std::string> paths = {path};
    paths.insert(paths.end(), also.begin(), also.end());
    return reader.Error(reader.LineFor(paths), path, what);
  };
  absl::Status own = absl::OkStatus();
  ForEachScalar(config, "", [&](const std::string& path, const Rule& rule, const auto& value) {
    if (!own.ok()) return;
    if (std::optional<std::string> what = CheckValue(rule, value)) own = fail(path, *what);
  });
  if (!own.ok()) return own;

  const ModelConfig& m = config.model;
  const DataConfig& d = config.data;
  const OptimConfig& o = config.optim;
  const TrainLoopConfig& t = config.train;
  const CheckpointConfig& c = config.checkpoint;
  if (m.dim % m.heads != 0) {
    return fail("model.heads", absl::StrCat(m.heads, " does not divide model.dim ", m.dim),
                {"model.dim"});
  }
  if (o.min_lr > o.lr) {
    return fail("optim.min_lr", absl::StrCat(o.min_lr, " is above optim.lr ", o.lr), {"optim.lr"});
  }
  if (t.eval_every > 0 && d.val.empty()) {
    return fail("train.eval_every", "evaluation needs data.val (a glob of token shards)");
  }
  // Only an explicit cpu is known here; with device auto the same mistake
  // surfaces when the trainer resolves both (ResolvePrecision).
  if (config.device == "cpu" && (config.precision == "tf32" || config.precision == "bf16")) {
    return fail("precision",
                absl::StrCat(config.precision, " needs device cuda; the CPU computes in fp32 only"),
                {"device"});
  }
  if (config.device == "cpu" && config.parallel.backend == "nccl") {
    return fail("parallel.backend",
                "nccl needs device cuda; on the CPU gradients are reduced over gloo", {"device"});
  }
  // The degrees' product is checked against the world when the worker
  // joins its peers (ParallelDimsFor, worker/strategy/strategy.h): the world size is not
  // known here. What no world can fix is refused now.
  const ParallelConfig& p = config.parallel;
  if (p.strategy == "ddp" && p.dp_shard > 1) {
    return fail("parallel.dp_shard",
                absl::StrCat(p.dp_shard,
                             " shards each replica, which needs parallel.strategy: fsdp; ddp "
                             "replicates the whole model: 0 (auto) or 1"),
                {"parallel.strategy"});
  }
  const bool interleaved = p.schedule == "interleaved_1f1b";
  const int V = VirtualStages(p);
  if (interleaved && V < 2) {
    return fail("parallel.virtual_stages",
                absl::StrCat(V,
                             " with interleaved_1f1b, which runs 2 or more pipeline stages per "
                             "rank (0: auto, 2)"),
                {"parallel.schedule"});
  }
  if (!interleaved && V != 1) {
    return fail("parallel.virtual_stages",
                absl::StrCat(V, " with parallel.schedule ", p.schedule,
                             ", which runs one pipeline stage per rank: 0 or 1, or use "
                             "interleaved_1f1b"),
                {"parallel.schedule"});
  }
  if (p.pp > 1) {
    if (p.pp * V > config.model.layers) {
      return fail("parallel.pp",
                  absl::StrCat(
                      p.pp * V, " pipeline stages",
                      V > 1 ? absl::StrCat(" (", p.pp, " ranks x ", V, " virtual stages)") : "",
                      " for ", config.model.layers, " blocks (model.layers): each stage needs one"),
                  {"model.layers", "parallel.virtual_stages"});
    }
    if (p.microbatches > 0 && config.data.grad_accumulation > 1) {
      return fail("data.grad_accumulation",
                  absl::StrCat(config.data.grad_accumulation, " with parallel.microbatches ",
                               p.microbatches,
                               ": a pipeline's micro-batches per step are parallel.microbatches "
                               "alone; leave data.grad_accumulation at 1"),
                  {"parallel.microbatches"});
    }
    const int M = MicroSteps(config);
    if (p.schedule != "gpipe" && M < p.pp) {
      return fail(
          "parallel.microbatches",
          absl::StrCat(M,
                       " micro-batches per step (parallel.microbatches, or "
                       "data.grad_accumulation when it is 0) is fewer than parallel.pp (",
                       p.pp, "): ", p.schedule, " never fills the pipeline; use more, or gpipe"),
          {"parallel.pp"});
    }
    if (interleaved && M % p.pp != 0) {
      return fail(
          "parallel.microbatches",
          absl::StrCat(M, " micro-batches per step is not a multiple of parallel.pp (", p.pp,
                       "): interleaved_1f1b sends micro-batches round in groups of pp"),
          {"parallel.pp"});
    }
  }
  if (!p.pp_split.empty()) {
    const std::string split = WriteScalar(p.pp_split);
    if (p.pp < 2) {
      return fail("parallel.pp_split",
                  absl::StrCat(split, " splits a pipeline, which needs parallel.pp above 1 (it is ",
                               p.pp, "); leave it empty ([])"),
                  {"parallel.pp"});
    }
    if (static_cast<int>(p.pp_split.size()) != p.pp * V) {
      return fail("parallel.pp_split",
                  absl::StrCat(split, " has ", p.pp_split.size(),
                               " entries; expected one per pipeline stage, parallel.pp ", p.pp,
                               V > 1 ? absl::StrCat(" x parallel.virtual_stages ", V) : ""),
                  {"parallel.pp"});
    }
    int64_t blocks = 0;
    for (size_t i = 0; i < p.pp_split.size(); ++i) {
      if (p.pp_split[i] < 1) {
        return fail("parallel.pp_split",
                    absl::StrCat(split, ": entry ", i + 1, " is ", p.pp_split[i],
                                 "; each stage needs at least 1 block"));
      }
      blocks += p.pp_split[i];
    }
    if (blocks != m.layers) {
      return fail(
          "parallel.pp_split",
          absl::StrCat(split, " sums to ", blocks, " blocks, but model.layers is ", m.layers),
          {"model.layers"});
    }
  }
  if (c.every > 0 && c.dir.empty()) {
    return fail("checkpoint.every", "saving checkpoints needs checkpoint.dir");
  }
  if (!c.dir.empty() && c.every > 0 && c.keep_last < 2) {
    return fail("checkpoint.keep_last",
                absl::StrCat(c.keep_last,
                             " is too few while checkpoints are on; keep at "
                             "least 2, so that one survives a bad newest one"),
                {"checkpoint.every", "checkpoint.dir"});
  }
  return absl::OkStatus();
}

// A relative path or glob names a place next to the yaml file.
std::string Resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || base_dir.empty() || path.front() == '/') return path;
  return (std::filesystem::path(base_dir) / path).lexically_normal().string();
}

}  // namespace

absl::StatusOr<TrainConfig> ParseConfig(const std::string& yaml_text, const std::string& name,
                                        const std::string& base_dir) {
  ConfigReader reader(name);
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& error) {
    return reader.Error(std::max(1, error.mark.line + 1), "",
                        absl::StrCat("invalid yaml: ", error.msg));
  }
  TrainConfig config;
  config.source = name;
  absl::Status status = reader.Read(root, &config);
  if (status.ok()) status = Validate(config, reader);
  if (!status.ok()) return status;
  // Every glob and path the tables mark, but not a word ("auto" for checkpoint.resume).
  ForEachScalar(config, "", [&](const std::string&, const Rule& rule, auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
      if (rule.path != PathKind::kNone && !IsWord(rule, value)) {
        value = Resolve(base_dir, value);
      }
    }
  });
  return config;
}

absl::StatusOr<TrainConfig> LoadConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the config file"));
  std::stringstream text;
  text << in.rdbuf();
  // An absolute base makes the resolved paths independent of the working
  // directory, so ConfigToYaml's output means the same from anywhere.
  std::error_code ignored;
  std::filesystem::path base =
      std::filesystem::absolute(std::filesystem::path(path), ignored).parent_path();
  return ParseConfig(text.str(), path, base.string());
}

std::string ConfigToYaml(const TrainConfig& config) {
  std::string out;
  if (!config.source.empty()) absl::StrAppend(&out, "# resolved from ", config.source, "\n");
  WriteYaml(config, "", &out);
  return out;
}

const std::vector<ConfigField>& ConfigFields() {
  static const std::vector<ConfigField>* const kFields = [] {
    auto* fields = new std::vector<ConfigField>;
    ListFields<TrainConfig>(
        "", [](auto& config) -> auto& { return config; }, fields);
    return fields;
  }();
  return *kFields;
}

bool operator==(const ModelConfig& a, const ModelConfig& b) { return Equal(a, b); }
bool operator==(const DataConfig& a, const DataConfig& b) { return Equal(a, b); }
bool operator==(const OptimConfig& a, const OptimConfig& b) { return Equal(a, b); }
bool operator==(const TrainLoopConfig& a, const TrainLoopConfig& b) { return Equal(a, b); }
bool operator==(const ParallelConfig& a, const ParallelConfig& b) { return Equal(a, b); }
bool operator==(const CheckpointConfig& a, const CheckpointConfig& b) { return Equal(a, b); }
bool operator==(const TrainConfig& a, const TrainConfig& b) {
  return a.source == b.source && Equal(a, b);
}

int VirtualStages(const ParallelConfig& parallel) {
  if (parallel.virtual_stages > 0) return parallel.virtual_stages;
  return parallel.schedule == "interleaved_1f1b" ? 2 : 1;
}

int MicroSteps(const TrainConfig& config) {
  if (config.parallel.pp > 1 && config.parallel.microbatches > 0) {
    return config.parallel.microbatches;
  }
  return config.data.grad_accumulation;
}

uint64_t ModelConfigHash(const ModelConfig& model) {
  // By hand, not from the table: checkpoints store the hash, so its fields
  // and their order are fixed even when the model gains a field.
  // FNV-1a over each field as 4 little-endian bytes, in a fixed order, so
  // the value is the same on every platform and build.
  uint64_t hash = 14695981039346656037ull;
  for (int32_t field : {model.layers, model.heads, model.dim, model.vocab, model.seq_len}) {
    uint32_t bits = static_cast<uint32_t>(field);
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (bits >> (8 * byte)) & 0xff;
      hash *= 1099511628211ull;
    }
  }
  return hash;
}

}  // namespace muster::worker
