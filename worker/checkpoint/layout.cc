#include "worker/checkpoint/layout.h"

#include <algorithm>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "parallel/process_group.h"
#include "worker/model/model_layout.h"

namespace muster::worker {

std::vector<StateTensor> StateTensors(const std::vector<Stage>& stages) {
  std::vector<StateTensor> tensors;
  uint64_t flat = 0;
  for (const char* part : {"params/", "adamw_m/", "adamw_v/"}) {
    for (const Stage& stage : stages) {
      for (const TensorView& view : stage.tensors) {
        StateTensor tensor;
        tensor.name = std::string(part) + stage.name + "." + view.name;
        tensor.shape.assign(view.shape.begin(), view.shape.end());
        tensor.flat_begin = flat + view.offset;
        tensor.count = view.size;
        tensors.push_back(std::move(tensor));
      }
      flat += stage.size;
    }
  }
  return tensors;
}

uint64_t StateFloats(const std::vector<StateTensor>& tensors) {
  uint64_t end = 0;
  for (const StateTensor& t : tensors) end = std::max(end, t.flat_begin + t.count);
  return end;
}

absl::Status CheckModelTensors(const Manifest& manifest) {
  const ModelConfig& model = manifest.model;
  const std::string dims =
      absl::StrCat("layers ", model.layers, ", heads ", model.heads, ", dim ", model.dim,
                   ", vocab ", model.vocab, ", seq_len ", model.seq_len);
  if (manifest.config_hash != ModelConfigHash(model)) {
    return absl::DataLossError(absl::StrCat("config_hash does not match its model (", dims, ")"));
  }
  // Shapes are ints (4C, Vp): dims that overflow them, or that would plan
  // more tensors than the manifest lists, are not the writer's.
  constexpr int kLargest = std::numeric_limits<int>::max() / 4;
  constexpr uint64_t kStageTensors = 12, kEdgeTensors = 4;  // per block; embedding + head
  const uint64_t expected_count =
      3 * (kEdgeTensors + kStageTensors * static_cast<uint64_t>(std::max(model.layers, 0)));
  if (model.layers < 1 || model.heads < 1 || model.dim < 1 || model.vocab < 1 ||
      model.seq_len < 1 || model.dim > kLargest || model.vocab > kLargest ||
      model.seq_len > kLargest || expected_count != manifest.tensors.size()) {
    return absl::DataLossError(absl::StrCat("its model (", dims, ") has ", expected_count,
                                            " tensors with AdamW's moments; the manifest lists ",
                                            manifest.tensors.size()));
  }
  std::map<std::string, const TensorRecord*> listed;
  for (const TensorRecord& record : manifest.tensors) listed[record.name] = &record;
  for (const StateTensor& tensor : StateTensors(layout::PlanStages(model))) {
    auto found = listed.find(tensor.name);
    if (found == listed.end()) {
      return absl::DataLossError(
          absl::StrCat("no tensor ", tensor.name, ", which its model (", dims, ") has"));
    }
    if (found->second->shape != tensor.shape) {
      return absl::DataLossError(absl::StrCat(
          "tensor ", tensor.name, " has shape [", absl::StrJoin(found->second->shape, ", "),
          "]; its model (", dims, ") gives [", absl::StrJoin(tensor.shape, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

std::vector<StateTensor> ManifestStateTensors(const Manifest& manifest) {
  std::vector<StateTensor> tensors;
  uint64_t flat = 0;
  for (const TensorRecord& record : manifest.tensors) {
    tensors.push_back({record.name, record.shape, flat, record.elements()});
    flat += record.elements();
  }
  return tensors;
}

void AppendRange(std::vector<FlatRange>* ranges, FlatRange range) {
  if (range.count == 0) return;
  if (!ranges->empty() && ranges->back().begin + ranges->back().count == range.begin) {
    ranges->back().count += range.count;
  } else {
    ranges->push_back(range);
  }
}

std::vector<FlatRange> StateRanges(const std::vector<FlatRange>& params_ranges, uint64_t total) {
  const uint64_t params = total / 3;
  std::vector<FlatRange> state;
  for (uint64_t part = 0; part < 3; ++part) {
    for (const FlatRange& range : params_ranges) {
      AppendRange(&state, {part * params + range.begin, range.count});
    }
  }
  return state;
}

std::vector<FlatRange> SplitRanges(const std::vector<FlatRange>& ranges, int parts, int index) {
  uint64_t total = 0;
  for (const FlatRange& range : ranges) total += range.count;
  const std::vector<size_t> counts = parallel::EvenCounts(total, parts);
  uint64_t lo = 0;
  for (int i = 0; i < index; ++i) lo += counts[i];
  const uint64_t hi = lo + counts[index];
  std::vector<FlatRange> out;
  uint64_t at = 0;  // where `range` starts in the concatenation
  for (const FlatRange& range : ranges) {
    const uint64_t a = std::max(lo, at), b = std::min(hi, at + range.count);
    if (a < b) out.push_back({range.begin + (a - at), b - a});
    at += range.count;
  }
  return out;
}

std::vector<FlatRange> EvenShards(uint64_t total, int world) {
  std::vector<FlatRange> ranges;
  uint64_t begin = 0;
  for (size_t count : parallel::EvenCounts(total, world)) {
    ranges.push_back({begin, count});
    begin += count;
  }
  return ranges;
}

std::vector<TensorRecord> SliceTensors(const std::vector<StateTensor>& tensors,
                                       const std::vector<std::vector<FlatRange>>& files) {
  // Where each range starts in its file, in floats.
  std::vector<std::vector<uint64_t>> file_offsets(files.size());
  for (size_t file = 0; file < files.size(); ++file) {
    uint64_t at = 0;
    for (const FlatRange& range : files[file]) {
      file_offsets[file].push_back(at);
      at += range.count;
    }
  }
  std::vector<TensorRecord> records;
  for (const StateTensor& tensor : tensors) {
    TensorRecord record;
    record.name = tensor.name;
    record.shape = tensor.shape;
    const uint64_t begin = tensor.flat_begin, end = tensor.flat_begin + tensor.count;
    for (size_t file = 0; file < files.size(); ++file) {
      for (size_t i = 0; i < files[file].size(); ++i) {
        const FlatRange& range = files[file][i];
        const uint64_t lo = std::max(begin, range.begin);
        const uint64_t hi = std::min(end, range.begin + range.count);
        if (lo >= hi) continue;
        TensorSlice slice;
        slice.file = static_cast<int>(file);
        slice.start = lo - begin;
        slice.count = hi - lo;
        slice.offset = (file_offsets[file][i] + (lo - range.begin)) * sizeof(float);
        record.slices.push_back(slice);
      }
    }
    // In tensor order, whichever files the pieces are in.
    std::sort(record.slices.begin(), record.slices.end(),
              [](const TensorSlice& a, const TensorSlice& b) { return a.start < b.start; });
    records.push_back(std::move(record));
  }
  return records;
}

}  // namespace muster::worker
