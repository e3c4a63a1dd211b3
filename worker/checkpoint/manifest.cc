#include "worker/checkpoint/manifest.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cinttypes>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "worker/checkpoint/files.h"

namespace muster::worker {

std::string StepDirName(int step) { return absl::StrFormat("step_%08d", step); }
std::string TempStepDirName(int step) { return absl::StrFormat(".tmp_step_%08d", step); }
std::string RankFileName(int rank) { return absl::StrFormat("rank_%05d.bin", rank); }

std::optional<int> ParseStepDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (name.size() != kPrefix.size() + 8 || name.substr(0, kPrefix.size()) != kPrefix) {
    return std::nullopt;
  }
  std::string_view digits = name.substr(kPrefix.size());
  if (!std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) return std::nullopt;
  int step = 0;
  if (!absl::SimpleAtoi(absl::string_view(digits.data(), digits.size()), &step))
    return std::nullopt;
  return step;
}

uint64_t TensorRecord::elements() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  return n;
}

const TensorRecord* Manifest::Find(std::string_view tensor_name) const {
  for (const TensorRecord& tensor : tensors) {
    if (tensor.name == tensor_name) return &tensor;
  }
  return nullptr;
}

std::string NewLineage() {
  std::random_device entropy;
  const uint64_t id = (static_cast<uint64_t>(entropy()) << 32) | entropy();
  return absl::StrFormat("%016" PRIx64, id);
}

std::string ForkLineage(const Manifest& source) {
  // FNV-1a over what identifies the source: stable across builds and
  // machines, which std::hash and absl::Hash do not promise.
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&hash](const std::string& text) {
    for (unsigned char c : text) hash = (hash ^ c) * 0x100000001b3ull;
  };
  mix(absl::StrCat(source.lineage, "@", source.step, "/", source.sample_index, "/",
                   source.config_hash));
  for (const FileRecord& file : source.files) mix(absl::StrCat(file.name, ":", file.crc32));
  return absl::StrFormat("%016" PRIx64, hash);
}

namespace {

// The manifest's own checksum: zlib's CRC-32 of the file's bytes with its
// 8 hex digits read as 0s. The writer puts it on the second line.
constexpr char kChecksumKey[] = "\"manifest_crc32\": \"";
constexpr char kZeroChecksum[] = "00000000";
constexpr size_t kChecksumDigits = sizeof(kZeroChecksum) - 1;

// Where the checksum's digits start in `json`; npos if it has none.
size_t ChecksumAt(const std::string& json) {
  const size_t key = json.find(kChecksumKey);
  if (key == std::string::npos) return key;
  return key + sizeof(kChecksumKey) - 1;
}

uint32_t ManifestCrc(std::string json, size_t at) {
  json.replace(at, kChecksumDigits, kZeroChecksum);
  return Crc32(0, json.data(), json.size());
}

}  // namespace

std::string ManifestToJson(const Manifest& m) {
  std::string out = absl::StrCat("{\n  ", kChecksumKey, kZeroChecksum, "\",\n");
  // 64-bit values are strings: JSON readers commonly hold numbers in doubles.
  absl::StrAppend(
      &out, "  \"format_version\": ", m.format_version, ",\n", "  \"step\": ", m.step, ",\n",
      "  \"optimizer_step\": ", m.optimizer_step, ",\n", "  \"sample_index\": \"", m.sample_index,
      "\",\n", "  \"data_seed\": \"", m.data_seed, "\",\n", "  \"data_windows\": \"",
      m.data_windows, "\",\n", "  \"global_batch\": \"", m.global_batch, "\",\n",
      "  \"val_samples\": \"", m.val_samples, "\",\n",
      absl::StrFormat("  \"config_hash\": \"%016" PRIx64 "\",\n", m.config_hash),
      "  \"model\": {\"layers\": ", m.model.layers, ", \"heads\": ", m.model.heads,
      ", \"dim\": ", m.model.dim, ", \"vocab\": ", m.model.vocab,
      ", \"seq_len\": ", m.model.seq_len, "},\n", "  \"world_size\": ", m.world_size, ",\n",
      "  \"strategy\": \"", m.strategy, "\",\n", "  \"lineage\": \"", m.lineage, "\",\n");
  if (!m.training.empty()) {
    // Values are yaml scalars ("\"cosine\"", "3e-04"): escaped as JSON strings.
    auto quoted = [](const std::string& text) {
      return absl::StrCat("\"", absl::StrReplaceAll(text, {{"\\", "\\\\"}, {"\"", "\\\""}}), "\"");
    };
    std::vector<std::string> settings;
    for (const auto& [path, value] : m.training) {
      settings.push_back(absl::StrCat(quoted(path), ": ", quoted(value)));
    }
    absl::StrAppend(&out, "  \"training\": {", absl::StrJoin(settings, ", "), "},\n");
  }
  absl::StrAppend(&out, "  \"files\": [\n");
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileRecord& f = m.files[i];
    absl::StrAppend(&out, "    {\"name\": \"", f.name, "\", \"bytes\": \"", f.bytes,
                    absl::StrFormat("\", \"crc32\": \"%08x\"}", f.crc32),
                    i + 1 < m.files.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"tensors\": [\n");
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorRecord& t = m.tensors[i];
    absl::StrAppend(&out, "    {\"name\": \"", t.name, "\", \"shape\": [",
                    absl::StrJoin(t.shape, ", "), "], \"dtype\": \"", t.dtype, "\", \"slices\": [");
    for (size_t j = 0; j < t.slices.size(); ++j) {
      const TensorSlice& s = t.slices[j];
      absl::StrAppend(&out, j > 0 ? ", " : "", "{\"file\": ", s.file, ", \"start\": \"", s.start,
                      "\", \"count\": \"", s.count, "\", \"offset\": \"", s.offset, "\"}");
    }
    absl::StrAppend(&out, "]}", i + 1 < m.tensors.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ]\n}\n");
  const size_t at = ChecksumAt(out);
  out.replace(at, kChecksumDigits, absl::StrFormat("%08x", ManifestCrc(out, at)));
  return out;
}

namespace {

// yaml-cpp reads JSON (a subset of YAML's flow style); its exceptions are
// caught at the top and turned into DATA_LOSS.
struct Parser {
  const std::string& source;

  YAML::Node Field(const YAML::Node& node, const char* key) const {
    YAML::Node value = node[key];
    if (!value) throw std::runtime_error(absl::StrCat("missing field \"", key, "\""));
    return value;
  }
  template <typename T>
  T Number(const YAML::Node& node, const char* key, int base = 10) const {
    YAML::Node field = Field(node, key);
    if (!field.IsScalar()) {
      throw std::runtime_error(absl::StrCat("field \"", key, "\" is not a number"));
    }
    std::string text = field.as<std::string>();
    uint64_t value = 0;
    bool ok = base == 16 ? absl::SimpleHexAtoi(text, &value) : absl::SimpleAtoi(text, &value);
    if (!ok || value > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
      throw std::runtime_error(
          absl::StrCat("field \"", key, "\": \"", text, "\" is not a valid unsigned number"));
    }
    return static_cast<T>(value);
  }
};

// A byte range of a file that a tensor slice claims.
struct Claim {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  const std::string* tensor = nullptr;
};

// Each file must be exactly its claims laid end to end: SliceTensors lays
// a rank's ranges densely from byte 0. A slice moved to another file or
// offset by a damaged manifest overlaps or leaves a gap, and would load
// other floats than it names (and read a file out of order for its CRC).
absl::Status CheckFilesTiled(const Manifest& m, std::vector<std::vector<Claim>>& claims) {
  for (size_t f = 0; f < m.files.size(); ++f) {
    std::vector<Claim>& in_file = claims[f];
    std::sort(in_file.begin(), in_file.end(),
              [](const Claim& a, const Claim& b) { return a.offset < b.offset; });
    const FileRecord& file = m.files[f];
    uint64_t at = 0;
    const std::string* previous = nullptr;
    for (const Claim& claim : in_file) {
      if (claim.offset < at) {
        return absl::DataLossError(absl::StrCat("file ", file.name, ": tensor ", *claim.tensor,
                                                "'s slice at byte ", claim.offset,
                                                " overlaps tensor ", *previous, "'s"));
      }
      if (claim.offset > at) {
        return absl::DataLossError(absl::StrCat("file ", file.name, ": bytes ", at, " to ",
                                                claim.offset, " belong to no tensor's slice"));
      }
      at = claim.offset + claim.bytes;
      previous = claim.tensor;
    }
    if (at != file.bytes) {
      return absl::DataLossError(absl::StrCat("file ", file.name, ": bytes ", at, " to ",
                                              file.bytes, " belong to no tensor's slice"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckConsistent(const Manifest& m) {
  // One file per rank (ReadSidecar per rank in the writer).
  if (m.world_size < 1 || static_cast<size_t>(m.world_size) != m.files.size()) {
    return absl::DataLossError(absl::StrCat("world_size ", m.world_size, " but ", m.files.size(),
                                            " files (one per rank)"));
  }
  std::set<std::string> file_names, tensor_names;
  for (const FileRecord& file : m.files) {
    if (!file_names.insert(file.name).second) {
      return absl::DataLossError(absl::StrCat("file ", file.name, " is listed twice"));
    }
  }
  std::vector<std::vector<Claim>> claims(m.files.size());
  for (const TensorRecord& tensor : m.tensors) {
    if (!tensor_names.insert(tensor.name).second) {
      return absl::DataLossError(absl::StrCat("tensor ", tensor.name, " is listed twice"));
    }
    if (tensor.dtype != "f32") {
      return absl::DataLossError(absl::StrCat("tensor ", tensor.name, ": dtype ", tensor.dtype,
                                              "; only f32 is supported"));
    }
    uint64_t elements = 1;
    for (int64_t dim : tensor.shape) {
      if (dim < 0 || __builtin_mul_overflow(elements, static_cast<uint64_t>(dim), &elements)) {
        return absl::DataLossError(absl::StrCat("tensor ", tensor.name, ": shape [",
                                                absl::StrJoin(tensor.shape, ", "),
                                                "] is not a valid shape"));
      }
    }
    std::vector<TensorSlice> slices = tensor.slices;
    std::sort(slices.begin(), slices.end(),
              [](const TensorSlice& a, const TensorSlice& b) { return a.start < b.start; });
    uint64_t covered = 0;
    for (const TensorSlice& slice : slices) {
      if (slice.start != covered) {
        return absl::DataLossError(absl::StrCat("tensor ", tensor.name,
                                                ": its slices leave a gap "
                                                "or overlap at element ",
                                                covered));
      }
      if (slice.file < 0 || slice.file >= static_cast<int>(m.files.size())) {
        return absl::DataLossError(absl::StrCat("tensor ", tensor.name, ": slice names file ",
                                                slice.file, " of ", m.files.size()));
      }
      const uint64_t file_bytes = m.files[slice.file].bytes;
      if (slice.count > file_bytes / sizeof(float) ||
          slice.offset > file_bytes - slice.count * sizeof(float)) {
        return absl::DataLossError(absl::StrCat("tensor ", tensor.name, ": a slice ends past the ",
                                                file_bytes, " bytes of ",
                                                m.files[slice.file].name));
      }
      if (slice.count > 0) {
        claims[slice.file].push_back({slice.offset, slice.count * sizeof(float), &tensor.name});
      }
      covered += slice.count;
    }
    if (covered != elements) {
      return absl::DataLossError(absl::StrCat("tensor ", tensor.name, ": slices cover ", covered,
                                              " of ", elements, " elements"));
    }
  }
  return CheckFilesTiled(m, claims);
}

}  // namespace

absl::StatusOr<Manifest> ParseManifest(const std::string& json, const std::string& source) {
  Manifest m;
  Parser p{source};
  try {
    YAML::Node root = YAML::Load(json);
    if (!root.IsMap()) throw std::runtime_error("not a JSON object");
    m.format_version = p.Number<int>(root, "format_version");
    if (m.format_version != kCheckpointFormatVersion) {
      return absl::DataLossError(absl::StrCat(source, ": format_version ", m.format_version,
                                              "; this build reads version ",
                                              kCheckpointFormatVersion));
    }
    // Absent in manifests written before it existed: those are read as
    // they are, checked by the consistency checks alone.
    if (root["manifest_crc32"]) {
      const uint32_t recorded = p.Number<uint32_t>(root, "manifest_crc32", 16);
      const size_t at = ChecksumAt(json);
      if (at == std::string::npos || at + kChecksumDigits > json.size()) {
        throw std::runtime_error("field \"manifest_crc32\" is not written as the writer does");
      }
      const uint32_t actual = ManifestCrc(json, at);
      if (actual != recorded) {
        return absl::DataLossError(absl::StrFormat(
            "%s: manifest_crc32 is %08x but the manifest's CRC-32 is %08x: it was changed or "
            "damaged after it was written",
            source, recorded, actual));
      }
    }
    m.step = p.Number<int>(root, "step");
    m.optimizer_step = p.Number<int>(root, "optimizer_step");
    m.sample_index = p.Number<uint64_t>(root, "sample_index");
    m.data_seed = p.Number<uint64_t>(root, "data_seed");
    if (root["data_windows"]) m.data_windows = p.Number<uint64_t>(root, "data_windows");
    if (root["global_batch"]) m.global_batch = p.Number<uint64_t>(root, "global_batch");
    if (root["val_samples"]) m.val_samples = p.Number<uint64_t>(root, "val_samples");
    m.config_hash = p.Number<uint64_t>(root, "config_hash", 16);
    YAML::Node model = p.Field(root, "model");
    m.model.layers = p.Number<int>(model, "layers");
    m.model.heads = p.Number<int>(model, "heads");
    m.model.dim = p.Number<int>(model, "dim");
    m.model.vocab = p.Number<int>(model, "vocab");
    m.model.seq_len = p.Number<int>(model, "seq_len");
    m.world_size = p.Number<int>(root, "world_size");
    m.strategy = p.Field(root, "strategy").as<std::string>();
    if (root["lineage"]) m.lineage = root["lineage"].as<std::string>();
    if (YAML::Node training = root["training"]) {
      if (!training.IsMap()) throw std::runtime_error("\"training\" is not an object");
      for (const auto& setting : training) {
        m.training.emplace_back(setting.first.as<std::string>(), setting.second.as<std::string>());
      }
    }
    for (const YAML::Node& file : p.Field(root, "files")) {
      FileRecord record;
      record.name = p.Field(file, "name").as<std::string>();
      if (record.name.empty() || record.name.find('/') != std::string::npos) {
        throw std::runtime_error(
            absl::StrCat("file name \"", record.name, "\" is not a plain file name"));
      }
      record.bytes = p.Number<uint64_t>(file, "bytes");
      record.crc32 = p.Number<uint32_t>(file, "crc32", 16);
      m.files.push_back(record);
    }
    for (const YAML::Node& tensor : p.Field(root, "tensors")) {
      TensorRecord record;
      record.name = p.Field(tensor, "name").as<std::string>();
      for (const YAML::Node& dim : p.Field(tensor, "shape"))
        record.shape.push_back(dim.as<int64_t>());
      record.dtype = p.Field(tensor, "dtype").as<std::string>();
      for (const YAML::Node& slice : p.Field(tensor, "slices")) {
        TensorSlice s;
        s.file = p.Number<int>(slice, "file");
        s.start = p.Number<uint64_t>(slice, "start");
        s.count = p.Number<uint64_t>(slice, "count");
        s.offset = p.Number<uint64_t>(slice, "offset");
        record.slices.push_back(s);
      }
      m.tensors.push_back(std::move(record));
    }
  } catch (const YAML::ParserException& error) {
    // The parser is an implementation detail: the file is JSON to its reader.
    return absl::DataLossError(absl::StrCat(source, ": not valid JSON at line ",
                                            error.mark.line + 1, ", column ", error.mark.column + 1,
                                            ": ", absl::CEscape(error.msg)));
  } catch (const YAML::Exception& error) {
    // A value of the wrong kind (an object where a number belongs, ...).
    std::string where;
    if (!error.mark.is_null()) {
      where = absl::StrCat(" at line ", error.mark.line + 1, ", column ", error.mark.column + 1);
    }
    return absl::DataLossError(absl::StrCat(source, ": not a valid checkpoint manifest", where,
                                            ": ", absl::CEscape(error.msg)));
  } catch (const std::exception& error) {
    return absl::DataLossError(
        absl::StrCat(source, ": not a valid checkpoint manifest: ", error.what()));
  }
  if (absl::Status consistent = CheckConsistent(m); !consistent.ok()) {
    return absl::DataLossError(absl::StrCat(source, ": ", consistent.message()));
  }
  return m;
}

}  // namespace muster::worker
