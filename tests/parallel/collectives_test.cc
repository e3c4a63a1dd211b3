// The control plane (parallel/collectives.h): blocking calls over real Gloo
// groups, each rank on a thread of its own (OnEveryRank), and over a self
// group. Results are checked on the test thread.
#include "parallel/collectives.h"

#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "parallel/forwarding_group.h"
#include "parallel/self_group.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

constexpr int64_t kBig = (int64_t{1} << 55) + 3;  // not a double's neighbour of 2^55

GlooOptions Bounded() {
  GlooOptions options;
  options.timeout = absl::Seconds(30);  // every wait below is bounded by it
  return options;
}

TEST_CASE("Broadcast(string): root's string of any length reaches every rank") {
  const int size = GENERATE(1, 2, 3);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size, Bounded());
  const std::string big(3 * 1024 * 1024 + 17, 'q');
  // Root, then what root sends; the other ranks start with strings of
  // other lengths, which must be replaced whole.
  const std::vector<std::pair<int, std::string>> cases = {{0, "checkpoints/step_000120"},
                                                          {size - 1, ""},
                                                          {size / 2, std::string("a\0b", 3)},
                                                          {size - 1, big},
                                                          {0, "x"}};
  for (const auto& [root, message] : cases) {
    INFO("size " << size << ", root " << root << ", " << message.size() << " bytes");
    std::vector<std::pair<absl::Status, std::string>> got =
        OnEveryRank(size, [&, root = root, message = message](int rank) {
          Collectives control(groups[rank].get());
          std::string bytes = rank == root ? message : std::string(rank * 5 + 1, '#');
          absl::Status status = control.Broadcast(&bytes, root);
          return std::make_pair(status, bytes);
        });
    for (int rank = 0; rank < size; ++rank) {
      INFO("rank " << rank << ": " << got[rank].first.ToString());
      CHECK(got[rank].first.ok());
      CHECK(got[rank].second == message);
    }
  }
}

TEST_CASE("scalar reductions and broadcasts are exact") {
  const int size = GENERATE(1, 2, 3);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size, Bounded());
  struct Result {
    absl::StatusOr<int64_t> sum, min, max, from_last;
    absl::StatusOr<float> fmin, favg;
    absl::Status barrier, vector;
    std::vector<int64_t> votes;
  };
  std::vector<Result> got = OnEveryRank(size, [&](int rank) {
    Collectives control(groups[rank].get());
    Result result;
    result.sum = control.AllReduce(kBig + rank, ReduceOp::kSum);
    result.min = control.AllReduce(int64_t{-kBig} * (rank + 1), ReduceOp::kMin);
    result.max = control.AllReduce(int64_t{rank == 0 ? -1 : kBig}, ReduceOp::kMax);
    result.fmin = control.AllReduce(0.5f - rank, ReduceOp::kMin);
    result.favg = control.AllReduce(static_cast<float>(rank), ReduceOp::kAvg);
    result.from_last = control.Broadcast(rank == size - 1 ? kBig * 2 : int64_t{-7}, size - 1);
    result.barrier = control.Barrier();
    // A vote: every rank agrees (min) and some rank asks (max).
    result.votes = {rank == 1 ? 0 : 1, rank == 1 ? 1 : 0};
    result.vector = control.AllReduce(absl::MakeSpan(result.votes), ReduceOp::kMin);
    return result;
  });
  for (int rank = 0; rank < size; ++rank) {
    INFO("rank " << rank);
    const Result& r = got[rank];
    REQUIRE(r.sum.ok());
    CHECK(*r.sum == kBig * size + size * (size - 1) / 2);
    CHECK(*r.min == -kBig * size);
    CHECK(*r.max == (size == 1 ? -1 : kBig));
    CHECK(*r.fmin == 0.5f - (size - 1));
    CHECK(*r.favg == static_cast<float>(size - 1) / 2);
    CHECK(*r.from_last == kBig * 2);
    CHECK(r.barrier.ok());
    CHECK(r.vector.ok());
    CHECK(r.votes == (size > 1 ? std::vector<int64_t>{0, 0} : std::vector<int64_t>{1, 0}));
  }
}

TEST_CASE("LowestRankWith names the lowest flagged rank on every rank, -1 for none") {
  const int size = GENERATE(1, 2, 3);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size, Bounded());
  // Flagged ranks as a bit mask; every subset of the world.
  for (int mask = 0; mask < (1 << size); ++mask) {
    INFO("size " << size << ", flags " << mask);
    std::vector<absl::StatusOr<int>> got = OnEveryRank(size, [&](int rank) {
      return Collectives(groups[rank].get()).LowestRankWith((mask >> rank) & 1);
    });
    int expected = -1;
    for (int rank = size - 1; rank >= 0; --rank) {
      if ((mask >> rank) & 1) expected = rank;
    }
    for (int rank = 0; rank < size; ++rank) {
      REQUIRE(got[rank].ok());
      CHECK(*got[rank] == expected);
    }
  }
}

TEST_CASE("the group's errors are the control plane's") {
  std::unique_ptr<ProcessGroup> self = CreateSelfGroup();
  Collectives control(self.get());
  CHECK(absl::IsInvalidArgument(control.AllReduce(int64_t{1}, ReduceOp::kAvg).status()));
  std::string bytes = "x";
  CHECK(absl::IsInvalidArgument(control.Broadcast(&bytes, 1)));
  CHECK(absl::IsInvalidArgument(control.Broadcast(nullptr, 0)));
  CHECK(absl::IsInvalidArgument(control.Broadcast(int64_t{3}, -1).status()));
  const absl::Status cause = absl::UnavailableError("connection to rank 1 failed");
  self->Abort(cause);
  CHECK(control.Barrier() == cause);
  CHECK(control.AllReduce(2.0f, ReduceOp::kSum).status() == cause);
  CHECK(control.Broadcast(&bytes, 0) == cause);
}

TEST_CASE("over a self group every call is local and immediate") {
  std::unique_ptr<ProcessGroup> self = CreateSelfGroup();
  Collectives control(self.get());
  CHECK(control.rank() == 0);
  CHECK(control.size() == 1);
  CHECK(&control.group() == self.get());
  CHECK(*control.AllReduce(kBig, ReduceOp::kSum) == kBig);
  CHECK(*control.AllReduce(-2.5f, ReduceOp::kAvg) == -2.5f);
  CHECK(*control.Broadcast(kBig, 0) == kBig);
  std::string bytes = "only me";
  CHECK(control.Broadcast(&bytes, 0).ok());
  CHECK(bytes == "only me");
  CHECK(control.Barrier().ok());
}

// A group that, like NCCL's, takes device memory only, and counts what
// reaches it.
class DeviceMemoryOnly final : public ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  bool takes_host_memory() const override { return false; }
  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    ++issued;
    return ForwardingGroup::AllReduce(data, op);
  }
  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) override {
    ++issued;
    return ForwardingGroup::AllReduceInt64(data, op);
  }
  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    ++issued;
    return ForwardingGroup::AllGather(input, output, std::move(counts));
  }
  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    ++issued;
    return ForwardingGroup::BroadcastBytes(data, root);
  }
  int issued = 0;
};

TEST_CASE("over a group that takes device memory only, every call with a buffer is refused") {
  std::unique_ptr<ProcessGroup> self = CreateSelfGroup();
  DeviceMemoryOnly device_only(self.get());
  Collectives control(&device_only);
  auto refused = [](const absl::Status& status) {
    INFO(status.ToString());
    return status.code() == absl::StatusCode::kFailedPrecondition &&
           absl::StrContains(status.message(), "device memory only");
  };
  int64_t ints[2] = {1, 2};
  float floats[2] = {1, 2};
  CHECK(refused(control.AllReduce(absl::MakeSpan(ints), ReduceOp::kSum)));
  CHECK(refused(control.AllReduce(absl::MakeSpan(floats), ReduceOp::kSum)));
  CHECK(refused(control.AllReduce(kBig, ReduceOp::kMax).status()));
  CHECK(refused(control.AllReduce(1.0f, ReduceOp::kSum).status()));
  CHECK(refused(control.SumDouble(1.0).status()));
  CHECK(refused(control.Broadcast(kBig, 0).status()));
  std::string bytes = "host memory";
  CHECK(refused(control.Broadcast(&bytes, 0)));
  CHECK(device_only.issued == 0);  // nothing reached the group
  CHECK(control.Barrier().ok());   // no buffer: allowed
  // The group still works for what it takes.
  CHECK(self->takes_host_memory());
}

}  // namespace
}  // namespace muster::parallel::testing
