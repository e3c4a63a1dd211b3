// The CUDA entry points of a build without --config=cuda: there is no GPU
// back end to make.
#include "worker/ops.h"

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

}  // namespace muster::worker
