// Every operation of the Gloo ProcessGroup, as threads-as-ranks over an
// InMemoryStore, checked exactly (integer-valued floats make sums exact).
#include <numeric>

#include "absl/strings/match.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

using Works = std::vector<std::shared_ptr<Work>>;

TEST_CASE("EvenCounts splits as evenly as possible, the first chunks larger") {
  CHECK(EvenCounts(7, 3) == std::vector<size_t>{3, 2, 2});
  CHECK(EvenCounts(2, 3) == std::vector<size_t>{1, 1, 0});
  CHECK(EvenCounts(0, 2) == std::vector<size_t>{0, 0});
}

TEST_CASE("GroupMembers names a group's ranks by global rank and the group by name") {
  const GroupMembers world;  // the default: group rank == global rank
  CHECK(world.name == "world");
  CHECK(world.Global(3) == 3);
  CHECK(world.Peer(1) == "global rank 1 (rank 1 of group world)");
  CHECK(world.Describe("barrier", -1, 4, 2, 8) ==
        "barrier (group world of 8 ranks; op #4 on global rank 2)");

  const GroupMembers pipe{"act.pp.0.0", {0, 2}};
  CHECK(pipe.Global(0) == 0);
  CHECK(pipe.Global(1) == 2);
  CHECK(pipe.Global(5) == 5);  // not a member: left as it is
  CHECK(pipe.Peer(1) == "global rank 2 (rank 1 of group act.pp.0.0)");
  CHECK(pipe.Describe("recv of 1024 floats with tag 0 from", 1, 19, 0, 2) ==
        "recv of 1024 floats with tag 0 from global rank 2 (rank 1 of group act.pp.0.0; op #19 "
        "on global rank 0)");
  const GroupMembers shard{"dp_shard.1", {2, 3}};
  CHECK(shard.Describe("allreduce (sum) of 8 floats", -1, 5, 1, 2) ==
        "allreduce (sum) of 8 floats (group dp_shard.1 of 2 ranks; op #5 on global rank 3)");
  // A back end that does not number its operations (NCCL).
  CHECK(shard.Describe("broadcast of 8 floats from", 0, -1, 1, 2) ==
        "broadcast of 8 floats from global rank 2 (rank 0 of group dp_shard.1; on global rank 3)");

  CHECK(CheckMembers("t", world, 4).ok());
  CHECK(CheckMembers("t", pipe, 2).ok());
  CHECK(absl::IsInvalidArgument(CheckMembers("t", pipe, 3)));               // one per rank
  CHECK(absl::IsInvalidArgument(CheckMembers("t", {"twice", {1, 1}}, 2)));  // distinct
  CHECK(absl::IsInvalidArgument(CheckMembers("t", {"neg", {0, -1}}, 2)));
  CHECK(absl::IsInvalidArgument(CheckMembers("t", {"", {}}, 2)));  // a name
}

TEST_CASE("collectives give exact results for uneven and empty sizes") {
  const int size = GENERATE(2, 3);
  const size_t n = GENERATE(size_t{0}, size_t{1}, size_t{7}, size_t{1000003});
  INFO("size " << size << ", n " << n);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  const std::vector<float> sum = SumOverRanks(size, n);
  const std::vector<size_t> counts = EvenCounts(n, size);
  std::vector<size_t> offsets(size + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);

  SECTION("allreduce sum and avg") {
    std::vector<std::vector<float>> summed(size), averaged(size);
    Works works;
    for (int r = 0; r < size; ++r) {
      summed[r] = RankData(r, n);
      averaged[r] = RankData(r, n);
      works.push_back(groups[r]->AllReduce(absl::MakeSpan(summed[r]), ReduceOp::kSum));
    }
    for (int r = 0; r < size; ++r) {
      works.push_back(groups[r]->AllReduce(absl::MakeSpan(averaged[r]), ReduceOp::kAvg));
    }
    WaitAll(works);
    std::vector<float> mean = sum;
    for (float& value : mean) value /= static_cast<float>(size);
    for (int r = 0; r < size; ++r) {
      CHECK(summed[r] == sum);
      CHECK(averaged[r] == mean);
    }
  }

  SECTION("reduce_scatter sum and avg") {
    const ReduceOp op = GENERATE(ReduceOp::kSum, ReduceOp::kAvg);
    std::vector<std::vector<float>> inputs(size), outputs(size);
    Works works;
    for (int r = 0; r < size; ++r) {
      inputs[r] = RankData(r, n);
      outputs[r].assign(counts[r], -1.0f);
      works.push_back(groups[r]->ReduceScatter(inputs[r], absl::MakeSpan(outputs[r]), counts, op));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) {
      std::vector<float> expected(sum.begin() + offsets[r], sum.begin() + offsets[r + 1]);
      if (op == ReduceOp::kAvg) {
        for (float& value : expected) value /= static_cast<float>(size);
      }
      CHECK(outputs[r] == expected);
      CHECK(inputs[r] == RankData(r, n));  // input untouched
    }
  }

  SECTION("allgather") {
    std::vector<std::vector<float>> inputs(size), outputs(size);
    std::vector<float> expected;
    Works works;
    for (int r = 0; r < size; ++r) {
      std::vector<float> data = RankData(r, n);
      inputs[r].assign(data.begin() + offsets[r], data.begin() + offsets[r + 1]);
      expected.insert(expected.end(), inputs[r].begin(), inputs[r].end());
      outputs[r].assign(n, -1.0f);
      works.push_back(groups[r]->AllGather(inputs[r], absl::MakeSpan(outputs[r]), counts));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(outputs[r] == expected);
  }

  SECTION("allgather of bf16 bits: moved, never computed on") {
    std::vector<std::vector<uint16_t>> inputs(size), outputs(size);
    std::vector<uint16_t> expected;
    Works works;
    // Patterns that any arithmetic would change: NaN payloads, -0, all ones.
    const uint16_t patterns[] = {0x7fc1, 0x8000, 0xffff, 0x0001, 0x3f80};
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < counts[r]; ++i) {
        inputs[r].push_back(static_cast<uint16_t>(patterns[(i + r) % 5] ^ (i << 4)));
      }
      expected.insert(expected.end(), inputs[r].begin(), inputs[r].end());
      outputs[r].assign(n, 0x1234);
      works.push_back(groups[r]->AllGatherBf16(inputs[r], absl::MakeSpan(outputs[r]), counts));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(outputs[r] == expected);
  }

  SECTION("broadcast from a non-zero root") {
    const int root = size - 1;
    std::vector<std::vector<float>> data(size);
    Works works;
    for (int r = 0; r < size; ++r) {
      data[r] = RankData(r, n);
      works.push_back(groups[r]->Broadcast(absl::MakeSpan(data[r]), root));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(data[r] == RankData(root, n));
  }
}

TEST_CASE("a bf16 allgather with skewed counts, one of them 0, concatenates bit-exactly") {
  const int size = 3;
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  // Rank 1 contributes nothing; the others different lengths. The bits are
  // ones that any float arithmetic (or a conversion) would change: a quiet
  // NaN, -0, an all-ones NaN, a subnormal.
  const std::vector<size_t> counts = {5, 0, 3};
  const std::vector<std::vector<uint16_t>> inputs = {
      {0x7fc0, 0x8000, 0xffff, 0x0001, 0x7f81}, {}, {0xffff, 0x7fc0, 0x8000}};
  const std::vector<uint16_t> expected = {0x7fc0, 0x8000, 0xffff, 0x0001,
                                          0x7f81, 0xffff, 0x7fc0, 0x8000};
  std::vector<std::vector<uint16_t>> outputs(size, std::vector<uint16_t>(8, 0x1234));
  Works works;
  for (int r = 0; r < size; ++r) {
    works.push_back(groups[r]->AllGatherBf16(inputs[r], absl::MakeSpan(outputs[r]), counts));
  }
  WaitAll(works);
  for (int r = 0; r < size; ++r) CHECK(outputs[r] == expected);
}

TEST_CASE("reduce_scatter at 4 and 5 ranks, skewed counts with zeros, leaves inputs untouched") {
  // The ring passes running sums through two buffers in turn: more ranks
  // than 3 use both more than once, and a zero count skips a step's send and
  // receive on both ends.
  const int size = GENERATE(4, 5);
  INFO("size " << size);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  std::vector<size_t> counts = {0, 70001, 3, 0, 129};
  counts.resize(size);
  std::vector<size_t> offsets(size + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  const size_t n = offsets[size];
  const std::vector<float> sum = SumOverRanks(size, n);
  std::vector<std::vector<float>> inputs(size), outputs(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    inputs[r] = RankData(r, n);
    outputs[r].assign(counts[r], -1.0f);
    works.push_back(
        groups[r]->ReduceScatter(inputs[r], absl::MakeSpan(outputs[r]), counts, ReduceOp::kSum));
  }
  WaitAll(works);
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r);
    CHECK(outputs[r] == std::vector<float>(sum.begin() + offsets[r], sum.begin() + offsets[r + 1]));
    CHECK(inputs[r] == RankData(r, n));
  }
}

TEST_CASE("send and recv match by source and tag, in order") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 3);
  // Ranks 0 and 2 each send two tagged messages to rank 1; rank 1 receives
  // them in the order they were sent.
  std::vector<float> a = RankData(0, 5), b = RankData(0, 1000), c = RankData(2, 9);
  std::vector<float> got_a(5), got_b(1000), got_c(9), empty_out, empty_in;
  Works works = {
      groups[0]->Send(a, 1, /*tag=*/4),
      groups[0]->Send(b, 1, /*tag=*/17),
      groups[2]->Send(c, 1, /*tag=*/4),
      groups[2]->Send(empty_out, 1, /*tag=*/0),
      groups[1]->Recv(absl::MakeSpan(got_a), 0, 4),
      groups[1]->Recv(absl::MakeSpan(got_b), 0, 17),
      groups[1]->Recv(absl::MakeSpan(got_c), 2, 4),
      groups[1]->Recv(absl::MakeSpan(empty_in), 2, 0),
  };
  WaitAll(works);
  CHECK(got_a == a);
  CHECK(got_b == b);
  CHECK(got_c == c);
}

TEST_CASE("many operations queued before any wait run in issue order") {
  const int size = 3;
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  const int kRounds = 40;
  const size_t n = 101;
  // buffers[r][k]: rank r's buffer of round k; round k alternates ops that
  // feed each other (broadcast, then allreduce of the broadcast value).
  std::vector<std::vector<std::vector<float>>> buffers(size);
  Works works;
  for (int r = 0; r < size; ++r) buffers[r].resize(kRounds);
  for (int k = 0; k < kRounds; ++k) {
    for (int r = 0; r < size; ++r) {
      buffers[r][k] = RankData(r + k, n);
      works.push_back(groups[r]->Broadcast(absl::MakeSpan(buffers[r][k]), k % size));
      works.push_back(groups[r]->AllReduce(absl::MakeSpan(buffers[r][k]), ReduceOp::kSum));
      if (k % 10 == 0) works.push_back(groups[r]->Barrier());
    }
  }
  WaitAll(works);
  for (int k = 0; k < kRounds; ++k) {
    std::vector<float> expected = RankData(k % size + k, n);
    for (float& value : expected) value *= size;
    for (int r = 0; r < size; ++r) CHECK(buffers[r][k] == expected);
  }
}

TEST_CASE("bad arguments fail at once with INVALID_ARGUMENT and leave the group usable") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 2);
  std::vector<float> data(4, 1.0f), out(2);
  CHECK(groups[0]->ReduceScatter(data, absl::MakeSpan(out), {2}, ReduceOp::kSum)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(
      groups[0]->ReduceScatter(data, absl::MakeSpan(out), {1, 1}, ReduceOp::kSum)->Wait().code() ==
      absl::StatusCode::kInvalidArgument);
  CHECK(groups[0]->AllGather(data, absl::MakeSpan(out), {2, 2})->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  std::vector<uint16_t> halves(4, 1), halves_out(2);
  CHECK(groups[0]->AllGatherBf16(halves, absl::MakeSpan(halves_out), {2, 2})->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(groups[0]->Broadcast(absl::MakeSpan(data), 2)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(groups[0]->Send(data, 0, 1)->Wait().code() == absl::StatusCode::kInvalidArgument);
  CHECK(groups[0]->Recv(absl::MakeSpan(data), 1, -1)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  std::vector<float> other(4, 2.0f);
  WaitAll({groups[0]->AllReduce(absl::MakeSpan(data), ReduceOp::kSum),
           groups[1]->AllReduce(absl::MakeSpan(other), ReduceOp::kSum)});
  CHECK(data == std::vector<float>(4, 3.0f));
}

TEST_CASE("a group of one needs no peers") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 1);
  std::vector<float> data = RankData(0, 7), out(7);
  WaitAll({groups[0]->AllReduce(absl::MakeSpan(data), ReduceOp::kAvg),
           groups[0]->ReduceScatter(RankData(0, 7), absl::MakeSpan(out), {7}, ReduceOp::kSum),
           groups[0]->Barrier()});
  CHECK(data == RankData(0, 7));
  CHECK(out == RankData(0, 7));
}

TEST_CASE("CreateGlooGroup rejects bad arguments") {
  rdzv::InMemoryStore store;
  CHECK(CreateGlooGroup(&store, 2, 2).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(CreateGlooGroup(nullptr, 0, 1).status().code() == absl::StatusCode::kInvalidArgument);
  GlooOptions options;
  options.address = "192.0.2.1";  // TEST-NET: not a local address
  CHECK(CreateGlooGroup(&store, 0, 1, options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  GlooOptions members;
  members.members = {"pair", {4, 5, 6}};  // three global ranks for two
  absl::StatusOr<std::unique_ptr<ProcessGroup>> mismatched = CreateGlooGroup(&store, 0, 2, members);
  CHECK(mismatched.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(mismatched.status().message(), "'pair'"));
}

TEST_CASE("a group reports the members it was given; by default it is the world") {
  rdzv::InMemoryStore store;
  CHECK(ConnectGroups(store, 1)[0]->members().name == "world");
  GlooOptions options;
  options.members = {"dp_shard.1", {2, 3}};
  // A store of its own: in the first one, rank 1 could find the closed
  // world's address/0 and wait on it while rank 0 waited for address/1
  // (one run in three under load, a 60 s timeout).
  rdzv::InMemoryStore fresh;
  Groups groups = ConnectGroups(fresh, 2, options);
  for (int r = 0; r < 2; ++r) {
    CHECK(groups[r]->members().name == "dp_shard.1");
    CHECK(groups[r]->members().global_ranks == std::vector<int>{2, 3});
  }
}

}  // namespace
}  // namespace muster::parallel::testing
