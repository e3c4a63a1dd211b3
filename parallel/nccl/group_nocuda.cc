// CreateNcclGroup in a build without --config=cuda.
#include "parallel/nccl/group.h"

namespace muster::parallel {

std::string NcclVersionString() { return "NCCL (not built)"; }

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateNcclGroup(rdzv::Store*, int, int,
                                                              const NcclOptions&) {
  return absl::FailedPreconditionError("the NCCL process group needs a build with --config=cuda");
}

}  // namespace muster::parallel
