// The CUDA entry points of a build without --config=cuda: there is no GPU
// back end to make.
#include "worker/model/model_cuda.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

constexpr char kNoCuda[] =
    "device cuda: this worker was built without CUDA (rebuild with "
    "bazel build --config=cuda)";

}  // namespace

absl::Status CudaAvailable() { return absl::FailedPreconditionError(kNoCuda); }

absl::StatusOr<std::unique_ptr<Ops>> MakeCudaOps() {
  return absl::FailedPreconditionError(kNoCuda);
}

absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(Precision) {
  return absl::FailedPreconditionError(kNoCuda);
}

absl::StatusOr<std::unique_ptr<GptModel>> CreateCudaModel(const ModelConfig&, int, Precision,
                                                          ParamStorage, Attention) {
  return absl::FailedPreconditionError(kNoCuda);
}

absl::StatusOr<CudaDeviceChoice> SelectCudaDevice(int) {
  return absl::FailedPreconditionError(kNoCuda);
}

absl::StatusOr<size_t> CudaMemoryInUse() { return absl::FailedPreconditionError(kNoCuda); }

}  // namespace muster::worker
