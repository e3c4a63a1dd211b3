#include "worker/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "worker/config/config_file.h"
#include "worker/config/reader.h"
#include "worker/config/scalars.h"
#include "worker/config/validate.h"
#include "worker/config/walk.h"

// The config is read in three steps, a file each: reader.cc walks the
// yaml through the field tables (fields.h; scalars.cc reads and writes
// each value), validate.cc checks the values, alone and together, and
// here the paths are resolved. ConfigToYaml, operator== and ConfigFields
// walk the same tables.

namespace muster::worker {
namespace {

using config_detail::ConfigReader;
using config_detail::PathKind;
using config_detail::Rule;

// A relative path or glob names a place next to the yaml file.
std::string Resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || base_dir.empty() || path.front() == '/') return path;
  return (std::filesystem::path(base_dir) / path).lexically_normal().string();
}

// Where the second document of `text` starts: the first '---' line after
// some content of the first, else (a document after '...') its own line.
int SecondDocumentLine(const std::string& text, const YAML::Node& second) {
  std::istringstream lines(text);
  bool content = false;
  int number = 0;
  for (std::string line; std::getline(lines, line);) {
    ++number;
    const bool marker = line.rfind("---", 0) == 0 &&
                        (line.size() == 3 || line[3] == ' ' || line[3] == '\t' || line[3] == '\r');
    if (marker && content) return number;
    const size_t first = line.find_first_not_of(" \t\r");
    if (!marker && first != std::string::npos && line[first] != '#' && line[first] != '%') {
      content = true;
    }
  }
  return config_detail::LineOf(second, 1);
}

// yaml-cpp's message for text it cannot parse, made printable (it may quote
// the byte it stopped at), and what most often causes it when it does not
// say: a tab in an indentation ("illegal map value") or a file that is not
// text at all.
std::string InvalidYaml(const std::string& text, const YAML::Exception& error) {
  std::string message = absl::CEscape(error.msg);
  if (text.find('\0') != std::string::npos) {
    return absl::StrCat("invalid yaml: ", message, " (the file holds a NUL byte: it is not text)");
  }
  std::istringstream lines(text);
  int number = 0;
  for (std::string line; std::getline(lines, line) && number <= error.mark.line;) {
    ++number;
    const size_t indent_end = line.find_first_not_of(" \t");
    if (line.substr(0, indent_end).find('\t') != std::string::npos) {
      return absl::StrCat("invalid yaml: ", message, " (line ", number,
                          " indents with a tab; yaml indents with spaces only)");
    }
  }
  return absl::StrCat("invalid yaml: ", message);
}

// ParseConfig, and with `config_file` (LoadConfig's) the checks of the
// resolved paths against the file system too.
absl::StatusOr<TrainConfig> Parse(const std::string& yaml_text, const std::string& name,
                                  const std::string& base_dir, const std::string* config_file) {
  ConfigReader reader(name);
  std::vector<YAML::Node> documents;
  try {
    // Every document, not just the first: YAML::Load stops after it, and
    // whatever followed a '---' was silently ignored, even invalid text.
    documents = YAML::LoadAll(yaml_text);
  } catch (const YAML::Exception& error) {
    return reader.Error(std::max(1, error.mark.line + 1), "", InvalidYaml(yaml_text, error));
  }
  if (documents.size() > 1) {
    return reader.Error(SecondDocumentLine(yaml_text, documents[1]), "",
                        "a second yaml document; a train.yaml is one document: remove the '---' "
                        "and what follows, or merge it into the first");
  }
  YAML::Node root = documents.empty() ? YAML::Node() : documents.front();
  TrainConfig config;
  config.source = name;
  absl::Status status = reader.Read(root, &config);
  if (status.ok()) status = config_detail::Validate(config, reader);
  if (!status.ok()) return status;
  // Every glob and path the tables mark, but not a word ("auto" for checkpoint.resume).
  config_detail::ForEachScalar(config, "", [&](const std::string&, const Rule& rule, auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
      if (rule.path != PathKind::kNone && !config_detail::IsWord(rule, value)) {
        value = Resolve(base_dir, value);
      }
    }
  });
  if (config_file != nullptr) {
    status = config_detail::ValidatePaths(config, reader, *config_file);
    if (!status.ok()) return status;
  }
  return config;
}

}  // namespace

absl::StatusOr<TrainConfig> ParseConfig(const std::string& yaml_text, const std::string& name,
                                        const std::string& base_dir) {
  return Parse(yaml_text, name, base_dir, nullptr);
}

int64_t WorldSizeMultiple(const ParallelConfig& parallel) {
  // dp_shard is 1 under ddp whatever it says (LoadConfig refuses more).
  const int64_t shard = parallel.strategy == "fsdp" ? std::max(parallel.dp_shard, 1) : 1;
  return int64_t{std::max(parallel.dp_replicate, 1)} * shard * std::max(parallel.pp, 1);
}

bool WorldSizeFixed(const ParallelConfig& parallel) {
  return parallel.dp_replicate > 0 && (parallel.strategy != "fsdp" || parallel.dp_shard > 0);
}

absl::StatusOr<TrainConfig> LoadConfig(const std::string& path) {
  absl::StatusOr<std::string> text = config_detail::ReadConfigFile(path);
  if (!text.ok()) return text.status();
  // An absolute base makes the resolved paths independent of the working
  // directory, so ConfigToYaml's output means the same from anywhere.
  std::error_code ignored;
  std::filesystem::path base =
      std::filesystem::absolute(std::filesystem::path(path), ignored).parent_path();
  return Parse(*text, path, base.string(), &path);
}

std::string ConfigToYaml(const TrainConfig& config) {
  std::string out;
  if (!config.source.empty()) absl::StrAppend(&out, "# resolved from ", config.source, "\n");
  config_detail::WriteYaml(config, "", &out);
  return out;
}

const std::vector<ConfigField>& ConfigFields() {
  static const std::vector<ConfigField>* const kFields = [] {
    auto* fields = new std::vector<ConfigField>;
    config_detail::ListFields<TrainConfig>(
        "", [](auto& config) -> auto& { return config; }, fields);
    return fields;
  }();
  return *kFields;
}

bool operator==(const ModelConfig& a, const ModelConfig& b) { return config_detail::Equal(a, b); }
bool operator==(const DataConfig& a, const DataConfig& b) { return config_detail::Equal(a, b); }
bool operator==(const OptimConfig& a, const OptimConfig& b) { return config_detail::Equal(a, b); }
bool operator==(const TrainLoopConfig& a, const TrainLoopConfig& b) {
  return config_detail::Equal(a, b);
}
bool operator==(const ParallelConfig& a, const ParallelConfig& b) {
  return config_detail::Equal(a, b);
}
bool operator==(const CheckpointConfig& a, const CheckpointConfig& b) {
  return config_detail::Equal(a, b);
}
bool operator==(const TrainConfig& a, const TrainConfig& b) {
  return a.source == b.source && config_detail::Equal(a, b);
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
