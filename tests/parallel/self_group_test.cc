// The group of one rank: identities and copies, finished at once; the
// argument checks every back end makes; Abort.
#include "parallel/self_group.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace muster::parallel {
namespace {

TEST_CASE("a self group is rank 0 of 1, and every collective is the identity or a copy") {
  std::unique_ptr<ProcessGroup> group = CreateSelfGroup(absl::Seconds(7));
  CHECK(group->rank() == 0);
  CHECK(group->size() == 1);
  CHECK(group->timeout() == absl::Seconds(7));

  std::vector<float> floats = {-1.5f, 0.0f, 3.25f};
  const std::vector<float> original = floats;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
    std::shared_ptr<Work> work = group->AllReduce(absl::MakeSpan(floats), op);
    CHECK(work->Done());  // finished when issued
    CHECK(work->Wait().ok());
    CHECK(floats == original);
  }
  std::vector<int64_t> ints = {int64_t{1} << 62, -3};
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax}) {
    CHECK(group->AllReduceInt64(absl::MakeSpan(ints), op)->Wait().ok());
    CHECK(ints == std::vector<int64_t>{int64_t{1} << 62, -3});
  }
  std::vector<float> out(3, 9.0f);
  CHECK(group->ReduceScatter(original, absl::MakeSpan(out), {3}, ReduceOp::kAvg)->Wait().ok());
  CHECK(out == original);
  out.assign(3, 9.0f);
  CHECK(group->AllGather(original, absl::MakeSpan(out), {3})->Wait().ok());
  CHECK(out == original);
  const std::vector<uint16_t> halves = {0x7fc1, 0x8000, 0xffff};
  std::vector<uint16_t> halves_out(3, 0);
  CHECK(group->AllGatherBf16(halves, absl::MakeSpan(halves_out), {3})->Wait().ok());
  CHECK(halves_out == halves);
  CHECK(group->Broadcast(absl::MakeSpan(floats), 0)->Wait().ok());
  std::vector<uint8_t> bytes = {1, 2, 3};
  CHECK(group->BroadcastBytes(absl::MakeSpan(bytes), 0)->Wait().ok());
  CHECK(bytes == std::vector<uint8_t>{1, 2, 3});
  std::vector<uint8_t> none;
  CHECK(group->BroadcastBytes(absl::MakeSpan(none), 0)->Wait().ok());
  CHECK(group->Barrier()->Wait().ok());
  GroupHealth health = group->Health();
  CHECK(health.error.ok());
  CHECK_FALSE(health.running_since.has_value());
}

TEST_CASE("a self group checks arguments like every back end") {
  std::unique_ptr<ProcessGroup> group = CreateSelfGroup();
  std::vector<float> data(4, 1.0f), out(2);
  std::vector<int64_t> ints = {1};
  std::vector<uint8_t> bytes = {1};
  CHECK(
      absl::IsInvalidArgument(group->AllReduceInt64(absl::MakeSpan(ints), ReduceOp::kAvg)->Wait()));
  CHECK(absl::IsInvalidArgument(
      group->ReduceScatter(data, absl::MakeSpan(out), {2}, ReduceOp::kSum)->Wait()));
  CHECK(absl::IsInvalidArgument(group->AllGather(data, absl::MakeSpan(out), {4})->Wait()));
  std::vector<uint16_t> halves(4, 1), halves_out(2);
  CHECK(absl::IsInvalidArgument(
      group->AllGatherBf16(halves, absl::MakeSpan(halves_out), {4})->Wait()));
  CHECK(absl::IsInvalidArgument(group->Broadcast(absl::MakeSpan(data), 1)->Wait()));
  CHECK(absl::IsInvalidArgument(group->BroadcastBytes(absl::MakeSpan(bytes), 1)->Wait()));
  // There is no peer to talk to.
  CHECK(absl::IsInvalidArgument(group->Send(data, 0, 0)->Wait()));
  CHECK(absl::IsInvalidArgument(group->Recv(absl::MakeSpan(data), 0, 0)->Wait()));
  CHECK(absl::IsInvalidArgument(group->Send(data, 1, 0)->Wait()));
  CHECK(group->Health().error.ok());
  CHECK(group->Barrier()->Wait().ok());
}

TEST_CASE("an aborted self group fails every later operation with the first cause") {
  std::unique_ptr<ProcessGroup> group = CreateSelfGroup();
  const absl::Status cause = absl::AbortedError("rendezvous round 4 of job 'j' ended");
  group->Abort(cause);
  group->Abort(absl::UnavailableError("a later cause is ignored"));
  CHECK(group->Health().error == cause);
  std::vector<float> floats = {1.0f};
  std::vector<int64_t> ints = {1};
  std::vector<uint8_t> bytes = {1};
  CHECK(group->AllReduce(absl::MakeSpan(floats), ReduceOp::kSum)->Wait() == cause);
  CHECK(group->AllReduceInt64(absl::MakeSpan(ints), ReduceOp::kMax)->Wait() == cause);
  CHECK(group->BroadcastBytes(absl::MakeSpan(bytes), 0)->Wait() == cause);
  CHECK(group->Barrier()->Wait() == cause);
  std::vector<float> out(1, 5.0f);
  CHECK(group->AllGather(floats, absl::MakeSpan(out), {1})->Wait() == cause);
  CHECK(out == std::vector<float>{5.0f});  // nothing copied
  std::vector<uint16_t> halves = {0x7fc0}, halves_out = {0x1234};
  CHECK(group->AllGatherBf16(halves, absl::MakeSpan(halves_out), {1})->Wait() == cause);
  CHECK(halves_out == std::vector<uint16_t>{0x1234});  // nothing copied
}

}  // namespace
}  // namespace muster::parallel
