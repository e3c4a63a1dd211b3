// CreateHostStagedGroup's argument checks, in any build. Without
// --config=cuda it reports FAILED_PRECONDITION; with it (MUSTER_CUDA_BUILD,
// set by the BUILD file), a machine without a GPU gives INTERNAL and one
// with a GPU a group. The operations themselves need a GPU:
// tests/parallel/staged_group_cuda_test.cc.
#include "parallel/staged/group.h"
#include "absl/strings/match.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

TEST_CASE("a null inner group is INVALID_ARGUMENT") {
  absl::StatusOr<std::unique_ptr<ProcessGroup>> made = CreateHostStagedGroup(nullptr);
  INFO(made.status().ToString());
  CHECK(made.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(made.status().message(), "null"));
}

TEST_CASE("a negative device is INVALID_ARGUMENT") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 1);
  StagedOptions options;
  options.device = -1;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> made =
      CreateHostStagedGroup(inner[0].get(), options);
  INFO(made.status().ToString());
  CHECK(made.status().code() == absl::StatusCode::kInvalidArgument);
}

#ifndef MUSTER_CUDA_BUILD
TEST_CASE("without --config=cuda the group is FAILED_PRECONDITION, naming the flag") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 1);
  absl::StatusOr<std::unique_ptr<ProcessGroup>> made = CreateHostStagedGroup(inner[0].get());
  INFO(made.status().ToString());
  CHECK(made.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(made.status().message(), "--config=cuda"));
  // The inner group is untouched and still works.
  std::vector<float> data = RankData(0, 7);
  WaitAll({inner[0]->AllReduce(absl::MakeSpan(data), ReduceOp::kSum)});
  CHECK(data == RankData(0, 7));
}
#else
TEST_CASE("with --config=cuda: a group where there is a GPU, else INTERNAL naming CUDA") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 1);
  absl::StatusOr<std::unique_ptr<ProcessGroup>> made = CreateHostStagedGroup(inner[0].get());
  INFO(made.status().ToString());
  if (made.ok()) {
    CHECK((*made)->timeout() == inner[0]->timeout() + kCopyMargin);
  } else {
    CHECK(made.status().code() == absl::StatusCode::kInternal);
    CHECK(absl::StrContains(made.status().message(), "cuda"));
  }
}
#endif

}  // namespace
}  // namespace muster::parallel::testing
