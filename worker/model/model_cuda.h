// Internal to the model library: the CUDA engine behind GptModel::Create
// for Device::kCuda (model_cuda.cc; ops_nocuda.cc stands in for builds
// without --config=cuda and reports FAILED_PRECONDITION).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/config/config.h"
#include "worker/model/model.h"

namespace muster::worker {

absl::StatusOr<std::unique_ptr<GptModel>> CreateCudaModel(const ModelConfig& config, int max_batch,
                                                          Precision precision, ParamStorage storage,
                                                          Attention attention);

}  // namespace muster::worker
