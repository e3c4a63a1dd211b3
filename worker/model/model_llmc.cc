// llm.c's model file (docs/checkpoint-format.md): a header of 256 int32,
// then fp32 parameters tensor-major across layers (wte, wpe, ln1w[L],
// ln1b[L], qkvw[L], ...). Our buffers are stage-major (one block's twelve
// tensors together), so saving and loading permute whole tensors.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "worker/model/model.h"
#include "worker/model/model_layout.h"

namespace muster::worker {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "llm.c files are little-endian");

constexpr int kHeaderInts = 256;
constexpr int kMagic = 20240326;
constexpr int kVersionFp32 = 3;

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

// Calls fn(host_offset, floats) for every tensor in llm.c's file order,
// host_offset being the tensor's place in CopyParamsToHost's layout.
template <typename Fn>
void ForEachTensorInLlmcOrder(const std::vector<Stage>& stages, Fn fn) {
  std::vector<size_t> stage_start;
  size_t offset = 0;
  for (const Stage& stage : stages) {
    stage_start.push_back(offset);
    offset += stage.size;
  }
  auto visit = [&](size_t stage, size_t tensor) {
    const TensorView& view = stages[stage].tensors[tensor];
    fn(stage_start[stage] + view.offset, view.size);
  };
  const size_t head = stages.size() - 1;
  for (size_t tensor = 0; tensor < stages[0].tensors.size(); ++tensor) visit(0, tensor);
  for (size_t tensor = 0; tensor < layout::kNumBlockTensors; ++tensor) {
    for (size_t stage = 1; stage < head; ++stage) visit(stage, tensor);
  }
  for (size_t tensor = 0; tensor < stages[head].tensors.size(); ++tensor) visit(head, tensor);
}

}  // namespace

absl::Status GptModel::SaveLlmc(const std::string& path) const {
  int header[kHeaderInts] = {};
  header[0] = kMagic;
  header[1] = kVersionFp32;
  header[2] = config_.seq_len;
  header[3] = config_.vocab;
  header[4] = config_.layers;
  header[5] = config_.heads;
  header[6] = config_.dim;
  header[7] = config_.padded_vocab();
  const std::vector<float> params = CopyParamsToHost();

  File file(std::fopen(path.c_str(), "wb"));
  if (!file)
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot open for writing: ", std::strerror(errno)));
  bool ok = std::fwrite(header, sizeof(header), 1, file.get()) == 1;
  ForEachTensorInLlmcOrder(stages_, [&](size_t offset, size_t floats) {
    ok = ok && std::fwrite(params.data() + offset, sizeof(float), floats, file.get()) == floats;
  });
  ok = std::fflush(file.get()) == 0 && ok;
  if (!ok)
    return absl::UnavailableError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
  return absl::OkStatus();
}

absl::Status GptModel::LoadLlmc(const std::string& path) {
  File file(std::fopen(path.c_str(), "rb"));
  if (!file)
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  int header[kHeaderInts];
  if (std::fread(header, sizeof(header), 1, file.get()) != 1) {
    return absl::DataLossError(absl::StrCat(path, ": shorter than llm.c's 1024-byte header"));
  }
  if (header[0] != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not an llm.c model file (magic ",
                                                   header[0], ", expected ", kMagic, ")"));
  }
  if (header[1] != kVersionFp32) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": llm.c model file version ", header[1],
                                                   "; only version 3 (fp32) is supported"));
  }
  const struct {
    const char* name;
    int in_file;
    int in_config;
  } fields[] = {{"max_seq_len (seq_len)", header[2], config_.seq_len},
                {"vocab_size (vocab)", header[3], config_.vocab},
                {"num_layers (layers)", header[4], config_.layers},
                {"num_heads (heads)", header[5], config_.heads},
                {"channels (dim)", header[6], config_.dim},
                {"padded_vocab_size", header[7], config_.padded_vocab()}};
  for (const auto& field : fields) {
    if (field.in_file != field.in_config) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", field.name, " is ", field.in_file,
                                                     " in the file but ", field.in_config,
                                                     " in the model config"));
    }
  }

  std::vector<float> params(layout::TotalFloats(stages_));
  bool ok = true;
  ForEachTensorInLlmcOrder(stages_, [&](size_t offset, size_t floats) {
    ok = ok && std::fread(params.data() + offset, sizeof(float), floats, file.get()) == floats;
  });
  const size_t expected_bytes = sizeof(header) + params.size() * sizeof(float);
  if (!ok) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated; expected ", expected_bytes, " bytes for this config"));
  }
  if (std::fgetc(file.get()) != EOF) {
    return absl::DataLossError(
        absl::StrCat(path, ": longer than the ", expected_bytes, " bytes this config needs"));
  }
  CopyParamsFromHost(params);
  return absl::OkStatus();
}

}  // namespace muster::worker
