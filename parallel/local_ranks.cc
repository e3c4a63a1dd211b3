#include "parallel/local_ranks.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::parallel {

absl::Status FirstError(const std::vector<absl::Status>& statuses) {
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<ProcessGroup>>> ConnectLocalGroups(
    rdzv::Store* store, int size, const std::string& prefix, const GlooOptions& options) {
  rdzv::PrefixStore scoped(store, prefix);
  auto made = OnEveryRank(size, [&](int rank) {
    return CreateGlooGroup(prefix.empty() ? store : &scoped, rank, size, options);
  });
  std::vector<std::unique_ptr<ProcessGroup>> groups;
  for (int rank = 0; rank < size; ++rank) {
    if (!made[rank].ok()) {
      return absl::Status(made[rank].status().code(),
                          absl::StrCat("rank ", rank, ": ", made[rank].status().message()));
    }
    groups.push_back(*std::move(made[rank]));
  }
  return groups;
}

}  // namespace muster::parallel
