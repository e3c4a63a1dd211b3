#include "worker/checkpoint/layout.h"

#include <algorithm>

#include "parallel/process_group.h"

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
