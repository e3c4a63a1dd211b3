// CreateHostStagedGroup in a build without --config=cuda.
#include "parallel/staged/group.h"

#include "absl/strings/str_cat.h"

namespace muster::parallel {

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateHostStagedGroup(ProcessGroup* inner,
                                                                    const StagedOptions& options) {
  if (absl::Status bad = CheckStagedArguments(inner, options); !bad.ok()) return bad;
  return absl::FailedPreconditionError(
      "CreateHostStagedGroup: built without --config=cuda; the host-staged process group "
      "needs CUDA");
}

}  // namespace muster::parallel
