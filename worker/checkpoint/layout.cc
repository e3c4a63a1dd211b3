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
