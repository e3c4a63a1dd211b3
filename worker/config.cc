#include "worker/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
    case YAML::NodeType::Scalar: return absl::StrCat("'", node.Scalar(), "'");
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    default: return "nothing";
  }
}

// One line of yaml-cpp's position, 1-based; a null value's mark points past
// it, so callers pass the key's line as the fallback.
int LineOf(const YAML::Node& node, int fallback) {
  if (node.Type() == YAML::NodeType::Null || node.Mark().line < 0) return fallback;
  return node.Mark().line + 1;
}

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
  using FieldReader = std::function<absl::Status(const YAML::Node&, const std::string&, int)>;
  struct Field {
    std::string key;
    FieldReader read;
  };

  absl::Status ReadMap(const YAML::Node& map, const std::string& prefix, int line,
                       const std::vector<Field>& fields);

  FieldReader Int(int* out) {
    return [this, out](const YAML::Node& node, const std::string& path, int line) {
      if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return absl::OkStatus();
      int64_t wide;
      if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), &wide)) {
        return Error(line, path, absl::StrCat("expected a 32-bit integer, ", Describe(node),
                                              " is out of range"));
      }
      return Error(line, path, absl::StrCat("expected an integer, got ", Describe(node)));
    };
  }
  FieldReader Uint64(uint64_t* out) {
    return [this, out](const YAML::Node& node, const std::string& path, int line) {
      if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return absl::OkStatus();
      return Error(line, path,
                   absl::StrCat("expected a non-negative integer, got ", Describe(node)));
    };
  }
  FieldReader Double(double* out) {
    return [this, out](const YAML::Node& node, const std::string& path, int line) {
      if (node.IsScalar() && absl::SimpleAtod(node.Scalar(), out) && std::isfinite(*out)) {
        return absl::OkStatus();
      }
      return Error(line, path, absl::StrCat("expected a number, got ", Describe(node)));
    };
  }
  // A null value (`val:` with nothing after it) reads as the empty string.
  FieldReader String(std::string* out) {
    return [this, out](const YAML::Node& node, const std::string& path, int line) {
      if (node.IsNull()) {
        out->clear();
        return absl::OkStatus();
      }
      if (node.IsScalar()) {
        *out = node.Scalar();
        return absl::OkStatus();
      }
      return Error(line, path, absl::StrCat("expected a string, got ", Describe(node)));
    };
  }
  FieldReader Section(std::vector<Field> fields) {
    return [this, fields = std::move(fields)](const YAML::Node& node, const std::string& path,
                                              int line) {
      return ReadMap(node, path, line, fields);
    };
  }

  std::string name_;
  std::map<std::string, int> lines_;  // key path -> 1-based line of its value
};

absl::Status ConfigReader::ReadMap(const YAML::Node& map, const std::string& prefix, int line,
                                   const std::vector<Field>& fields) {
  if (map.IsNull()) return absl::OkStatus();  // an empty section keeps the defaults
  if (!map.IsMap()) {
    return Error(line, prefix, absl::StrCat("expected a map, got ", Describe(map)));
  }
  std::vector<std::string> known;
  for (const Field& field : fields) known.push_back(field.key);
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node key = it->first;
    const int key_line = key.Mark().line + 1;
    if (!key.IsScalar()) {
      return Error(key_line, prefix, absl::StrCat("expected a key, got ", Describe(key)));
    }
    const std::string path = prefix.empty() ? key.Scalar() : prefix + "." + key.Scalar();
    auto [seen, inserted] = lines_.emplace(path, key_line);
    if (!inserted) {
      return Error(key_line, path, absl::StrCat("duplicate key (first set on line ",
                                                seen->second, ")"));
    }
    auto field = std::find_if(fields.begin(), fields.end(),
                              [&](const Field& f) { return f.key == key.Scalar(); });
    if (field == fields.end()) {
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
    absl::Status status = field->read(it->second, path, LineOf(it->second, key_line));
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
                 absl::StrCat("expected a map of sections at the top level, got ",
                              Describe(root)));
  }
  ModelConfig& m = config->model;
  DataConfig& d = config->data;
  OptimConfig& o = config->optim;
  TrainLoopConfig& t = config->train;
  ParallelConfig& p = config->parallel;
  CheckpointConfig& c = config->checkpoint;
  std::vector<Field> sections = {
      {"model", Section({{"layers", Int(&m.layers)},
                         {"heads", Int(&m.heads)},
                         {"dim", Int(&m.dim)},
                         {"vocab", Int(&m.vocab)},
                         {"seq_len", Int(&m.seq_len)}})},
      {"data", Section({{"train", String(&d.train)},
                        {"val", String(&d.val)},
                        {"micro_batch", Int(&d.micro_batch)},
                        {"grad_accumulation", Int(&d.grad_accumulation)}})},
      {"optim", Section({{"lr", Double(&o.lr)},
                         {"warmup_steps", Int(&o.warmup_steps)},
                         {"schedule", String(&o.schedule)},
                         {"min_lr", Double(&o.min_lr)},
                         {"weight_decay", Double(&o.weight_decay)},
                         {"beta1", Double(&o.beta1)},
                         {"beta2", Double(&o.beta2)},
                         {"eps", Double(&o.eps)},
                         {"grad_clip", Double(&o.grad_clip)}})},
      {"train", Section({{"steps", Int(&t.steps)},
                         {"seed", Uint64(&t.seed)},
                         {"log_every", Int(&t.log_every)},
                         {"eval_every", Int(&t.eval_every)},
                         {"eval_batches", Int(&t.eval_batches)},
                         {"metrics_file", String(&t.metrics_file)}})},
      {"device", String(&config->device)},
      {"precision", String(&config->precision)},
      {"parallel", Section({{"strategy", String(&p.strategy)},
                            {"backend", String(&p.backend)},
                            {"bucket_mb", Double(&p.bucket_mb)},
                            {"timeout_s", Double(&p.timeout_s)}})},
      {"checkpoint", Section({{"dir", String(&c.dir)},
                              {"every", Int(&c.every)},
                              {"keep_last", Int(&c.keep_last)},
                              {"keep_every", Int(&c.keep_every)},
                              {"resume", String(&c.resume)}})},
  };
  return ReadMap(root, "", 1, sections);
}

// Every impossible value, checked after reading so that checks across
// fields see the final values whatever order the file wrote them in.
absl::Status Validate(const TrainConfig& config, const ConfigReader& reader) {
  auto fail = [&](const std::string& path, const std::string& what,
                  std::initializer_list<std::string> also = {}) {
    std::vector<std::string> paths = {path};
    paths.insert(paths.end(), also.begin(), also.end());
    return reader.Error(reader.LineFor(paths), path, what);
  };
  auto positive = [&](const std::string& path, double value) {
    return value > 0 ? absl::OkStatus()
                     : fail(path, absl::StrCat("must be > 0, got ", value));
  };
  auto non_negative = [&](const std::string& path, double value) {
    return value >= 0 ? absl::OkStatus()
                      : fail(path, absl::StrCat("must be >= 0, got ", value));
  };
  const ModelConfig& m = config.model;
  const DataConfig& d = config.data;
  const OptimConfig& o = config.optim;
  const TrainLoopConfig& t = config.train;
  const CheckpointConfig& c = config.checkpoint;
  for (absl::Status status : {
           positive("model.layers", m.layers), positive("model.heads", m.heads),
           positive("model.dim", m.dim), positive("model.vocab", m.vocab),
           positive("model.seq_len", m.seq_len), positive("data.micro_batch", d.micro_batch),
           positive("data.grad_accumulation", d.grad_accumulation),
           positive("optim.lr", o.lr), non_negative("optim.warmup_steps", o.warmup_steps),
           non_negative("optim.min_lr", o.min_lr),
           non_negative("optim.weight_decay", o.weight_decay),
           positive("optim.eps", o.eps), non_negative("optim.grad_clip", o.grad_clip),
           positive("train.steps", t.steps), positive("train.log_every", t.log_every),
           non_negative("train.eval_every", t.eval_every),
           positive("train.eval_batches", t.eval_batches),
           positive("parallel.bucket_mb", config.parallel.bucket_mb),
           positive("parallel.timeout_s", config.parallel.timeout_s),
           non_negative("checkpoint.every", c.every),
           non_negative("checkpoint.keep_last", c.keep_last),
           non_negative("checkpoint.keep_every", c.keep_every)}) {
    if (!status.ok()) return status;
  }
  if (m.dim % m.heads != 0) {
    return fail("model.heads", absl::StrCat(m.heads, " does not divide model.dim ", m.dim),
                {"model.dim"});
  }
  if (m.vocab > 65536) {
    return fail("model.vocab", absl::StrCat(m.vocab, " is more than 65536, the most that "
                                            "uint16 token ids can address"));
  }
  if (d.train.empty()) {
    return fail("data.train", "missing; expected a glob of token shards (llm.c format)");
  }
  if (o.min_lr > o.lr) {
    return fail("optim.min_lr", absl::StrCat(o.min_lr, " is above optim.lr ", o.lr),
                {"optim.lr"});
  }
  for (auto [path, beta] : {std::pair{"optim.beta1", o.beta1}, {"optim.beta2", o.beta2}}) {
    if (beta < 0 || beta >= 1) {
      return fail(path, absl::StrCat("expected a value in [0, 1), got ", beta));
    }
  }
  if (o.schedule != "cosine" && o.schedule != "constant") {
    return fail("optim.schedule",
                absl::StrCat("expected cosine or constant, got '", o.schedule, "'"));
  }
  if (t.eval_every > 0 && d.val.empty()) {
    return fail("train.eval_every", "evaluation needs data.val (a glob of token shards)");
  }
  if (config.device != "cpu" && config.device != "cuda" && config.device != "auto") {
    return fail("device", absl::StrCat("expected cpu, cuda or auto, got '", config.device, "'"));
  }
  if (config.precision != "auto" && config.precision != "fp32" && config.precision != "tf32" &&
      config.precision != "bf16") {
    return fail("precision", absl::StrCat("expected auto, fp32, tf32 or bf16, got '",
                                          config.precision, "'"));
  }
  // Only an explicit cpu is known here; with device auto the same mistake
  // surfaces when the trainer resolves both (ResolvePrecision).
  if (config.device == "cpu" && (config.precision == "tf32" || config.precision == "bf16")) {
    return fail("precision",
                absl::StrCat(config.precision, " needs device cuda; the CPU computes in fp32 only"),
                {"device"});
  }
  if (config.parallel.strategy != "ddp") {
    return fail("parallel.strategy", absl::StrCat("unknown strategy '",
                                                  config.parallel.strategy,
                                                  "'; known strategies: ddp"));
  }
  if (config.parallel.backend != "auto" && config.parallel.backend != "nccl" &&
      config.parallel.backend != "gloo") {
    return fail("parallel.backend", absl::StrCat("expected auto, nccl or gloo, got '",
                                                 config.parallel.backend, "'"));
  }
  if (config.device == "cpu" && config.parallel.backend == "nccl") {
    return fail("parallel.backend",
                "nccl needs device cuda; on the CPU gradients are reduced over gloo",
                {"device"});
  }
  if (c.every > 0 && c.dir.empty()) {
    return fail("checkpoint.every", "saving checkpoints needs checkpoint.dir");
  }
  if (!c.dir.empty() && c.every > 0 && c.keep_last < 2) {
    return fail("checkpoint.keep_last",
                absl::StrCat(c.keep_last, " is too few while checkpoints are on; keep at "
                                          "least 2, so that one survives a bad newest one"),
                {"checkpoint.every", "checkpoint.dir"});
  }
  if (c.resume.empty()) {
    return fail("checkpoint.resume", "expected auto, never or a checkpoint path, got ''");
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
    return reader.Error(std::max(1, error.mark.line + 1), "", absl::StrCat("invalid yaml: ", error.msg));
  }
  TrainConfig config;
  config.source = name;
  absl::Status status = reader.Read(root, &config);
  if (status.ok()) status = Validate(config, reader);
  if (!status.ok()) return status;
  config.data.train = Resolve(base_dir, config.data.train);
  config.data.val = Resolve(base_dir, config.data.val);
  config.train.metrics_file = Resolve(base_dir, config.train.metrics_file);
  config.checkpoint.dir = Resolve(base_dir, config.checkpoint.dir);
  if (config.checkpoint.resume != "auto" && config.checkpoint.resume != "never") {
    config.checkpoint.resume = Resolve(base_dir, config.checkpoint.resume);
  }
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

namespace {

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

}  // namespace

std::string ConfigToYaml(const TrainConfig& config) {
  const ModelConfig& m = config.model;
  const DataConfig& d = config.data;
  const OptimConfig& o = config.optim;
  const TrainLoopConfig& t = config.train;
  const CheckpointConfig& c = config.checkpoint;
  std::string out;
  if (!config.source.empty()) absl::StrAppend(&out, "# resolved from ", config.source, "\n");
  absl::StrAppend(&out, "model:\n", "  layers: ", m.layers, "\n", "  heads: ", m.heads, "\n",
                  "  dim: ", m.dim, "\n", "  vocab: ", m.vocab, "\n", "  seq_len: ", m.seq_len,
                  "\n");
  absl::StrAppend(&out, "data:\n", "  train: ", Quoted(d.train), "\n", "  val: ", Quoted(d.val),
                  "\n", "  micro_batch: ", d.micro_batch, "\n",
                  "  grad_accumulation: ", d.grad_accumulation, "\n");
  absl::StrAppend(&out, "optim:\n", "  lr: ", ExactDouble(o.lr), "\n",
                  "  warmup_steps: ", o.warmup_steps, "\n", "  schedule: ", Quoted(o.schedule),
                  "\n", "  min_lr: ", ExactDouble(o.min_lr), "\n",
                  "  weight_decay: ", ExactDouble(o.weight_decay), "\n");
  absl::StrAppend(&out, "  beta1: ", ExactDouble(o.beta1), "\n", "  beta2: ",
                  ExactDouble(o.beta2), "\n", "  eps: ", ExactDouble(o.eps), "\n",
                  "  grad_clip: ", ExactDouble(o.grad_clip), "\n");
  absl::StrAppend(&out, "train:\n", "  steps: ", t.steps, "\n", "  seed: ", t.seed, "\n",
                  "  log_every: ", t.log_every, "\n", "  eval_every: ", t.eval_every, "\n",
                  "  eval_batches: ", t.eval_batches, "\n",
                  "  metrics_file: ", Quoted(t.metrics_file), "\n");
  absl::StrAppend(&out, "device: ", Quoted(config.device), "\n");
  absl::StrAppend(&out, "precision: ", Quoted(config.precision), "\n");
  absl::StrAppend(&out, "parallel:\n", "  strategy: ", Quoted(config.parallel.strategy), "\n",
                  "  backend: ", Quoted(config.parallel.backend), "\n",
                  "  bucket_mb: ", ExactDouble(config.parallel.bucket_mb), "\n",
                  "  timeout_s: ", ExactDouble(config.parallel.timeout_s), "\n");
  absl::StrAppend(&out, "checkpoint:\n", "  dir: ", Quoted(c.dir), "\n", "  every: ", c.every,
                  "\n", "  keep_last: ", c.keep_last, "\n", "  keep_every: ", c.keep_every, "\n",
                  "  resume: ", Quoted(c.resume), "\n");
  return out;
}

bool operator==(const ModelConfig& a, const ModelConfig& b) {
  return std::tie(a.layers, a.heads, a.dim, a.vocab, a.seq_len) ==
         std::tie(b.layers, b.heads, b.dim, b.vocab, b.seq_len);
}
bool operator==(const DataConfig& a, const DataConfig& b) {
  return std::tie(a.train, a.val, a.micro_batch, a.grad_accumulation) ==
         std::tie(b.train, b.val, b.micro_batch, b.grad_accumulation);
}
bool operator==(const OptimConfig& a, const OptimConfig& b) {
  return std::tie(a.lr, a.warmup_steps, a.schedule, a.min_lr, a.weight_decay, a.beta1, a.beta2,
                  a.eps, a.grad_clip) == std::tie(b.lr, b.warmup_steps, b.schedule, b.min_lr,
                                                  b.weight_decay, b.beta1, b.beta2, b.eps,
                                                  b.grad_clip);
}
bool operator==(const TrainLoopConfig& a, const TrainLoopConfig& b) {
  return std::tie(a.steps, a.seed, a.log_every, a.eval_every, a.eval_batches, a.metrics_file) ==
         std::tie(b.steps, b.seed, b.log_every, b.eval_every, b.eval_batches, b.metrics_file);
}
bool operator==(const ParallelConfig& a, const ParallelConfig& b) {
  return std::tie(a.strategy, a.backend, a.bucket_mb, a.timeout_s) ==
         std::tie(b.strategy, b.backend, b.bucket_mb, b.timeout_s);
}
bool operator==(const CheckpointConfig& a, const CheckpointConfig& b) {
  return std::tie(a.dir, a.every, a.keep_last, a.keep_every, a.resume) ==
         std::tie(b.dir, b.every, b.keep_last, b.keep_every, b.resume);
}
bool operator==(const TrainConfig& a, const TrainConfig& b) {
  return std::tie(a.source, a.model, a.data, a.optim, a.train, a.device, a.precision,
                  a.parallel, a.checkpoint) == std::tie(b.source, b.model, b.data, b.optim,
                                                        b.train, b.device, b.precision,
                                                        b.parallel, b.checkpoint);
}

uint64_t ModelConfigHash(const ModelConfig& model) {
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
