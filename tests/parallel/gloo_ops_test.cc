// The Gloo group's typed operations: int64 allreduce (sum, min, max), float
// min and max (allreduce and reduce-scatter), and byte broadcast, at 1, 2
// and 3 ranks as threads over an InMemoryStore, checked exactly.
#include <cstdint>
#include <limits>
#include <numeric>

#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

using Works = std::vector<std::shared_ptr<Work>>;

constexpr int64_t kBig = int64_t{1} << 60;  // far above 2^53: a double would round

// Rank r's element i: huge positives, huge negatives and small mixed signs,
// different on every rank and never exactly representable as a double sum.
int64_t IntValue(int rank, size_t i) {
  const int64_t k = static_cast<int64_t>(i);
  switch (i % 3) {
    case 0:
      return kBig + 7 * k + 3 * rank + 1;
    case 1:
      return -(kBig / 4) * (rank + 1) - k;
    default:
      return k * (rank - 1) - 5;
  }
}

std::vector<int64_t> IntData(int rank, size_t n) {
  std::vector<int64_t> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = IntValue(rank, i);
  return data;
}

// Non-integer floats of both signs: min and max move no arithmetic.
float FloatValue(int rank, size_t i) {
  return static_cast<float>((i * 7 + rank * 13) % 101) - 50.0f + 0.25f * rank;
}

std::vector<float> FloatData(int rank, size_t n) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = FloatValue(rank, i);
  return data;
}

template <typename T>
T Reduce(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kMax:
      return std::max(a, b);
    default:
      return a + b;
  }
}

std::vector<int64_t> ExpectedInts(ReduceOp op, int size, size_t n) {
  std::vector<int64_t> expected = IntData(0, n);
  for (int r = 1; r < size; ++r) {
    for (size_t i = 0; i < n; ++i) expected[i] = Reduce(op, expected[i], IntValue(r, i));
  }
  return expected;
}

std::vector<float> ExpectedFloats(ReduceOp op, int size, size_t n) {
  std::vector<float> expected = FloatData(0, n);
  for (int r = 1; r < size; ++r) {
    for (size_t i = 0; i < n; ++i) expected[i] = Reduce(op, expected[i], FloatValue(r, i));
  }
  return expected;
}

TEST_CASE("int64 allreduce is exact: sum, min and max, above 2^53 and below zero") {
  const int size = GENERATE(1, 2, 3);
  const size_t n = GENERATE(size_t{0}, size_t{1}, size_t{7}, size_t{100003});
  const ReduceOp op = GENERATE(ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax);
  INFO("size " << size << ", n " << n << ", op " << ReduceOpName(op));
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  std::vector<std::vector<int64_t>> data(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    data[r] = IntData(r, n);
    works.push_back(groups[r]->AllReduceInt64(absl::MakeSpan(data[r]), op));
  }
  WaitAll(works);
  const std::vector<int64_t> expected = ExpectedInts(op, size, n);
  for (int r = 0; r < size; ++r) CHECK(data[r] == expected);
  if (n > 0 && size > 1 && op == ReduceOp::kSum) {
    // The point of int64: a float (or double) sum would have lost these.
    CHECK(expected[0] == size * (kBig + 1) + 3 * (size * (size - 1) / 2));
  }
}

TEST_CASE("an int64 sum wraps modulo 2^64 rather than being undefined") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 2);
  std::vector<int64_t> a = {std::numeric_limits<int64_t>::max(), -1};
  std::vector<int64_t> b = {1, std::numeric_limits<int64_t>::min()};
  WaitAll({groups[0]->AllReduceInt64(absl::MakeSpan(a), ReduceOp::kSum),
           groups[1]->AllReduceInt64(absl::MakeSpan(b), ReduceOp::kSum)});
  const std::vector<int64_t> expected = {std::numeric_limits<int64_t>::min(),
                                         std::numeric_limits<int64_t>::max()};
  CHECK(a == expected);
  CHECK(b == expected);
}

TEST_CASE("int64 avg is INVALID_ARGUMENT, at once and without breaking the group") {
  const int size = GENERATE(1, 2);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  std::vector<int64_t> values = {1, 2};
  // Only rank 0 asks: nothing is sent, so no peer is left waiting.
  absl::Status status = groups[0]->AllReduceInt64(absl::MakeSpan(values), ReduceOp::kAvg)->Wait();
  INFO(status.ToString());
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Catch::Contains("avg"));
  CHECK(values == std::vector<int64_t>{1, 2});
  CHECK(groups[0]->Health().error.ok());
  std::vector<std::vector<int64_t>> data(size, std::vector<int64_t>{5});
  Works works;
  for (int r = 0; r < size; ++r) {
    works.push_back(groups[r]->AllReduceInt64(absl::MakeSpan(data[r]), ReduceOp::kSum));
  }
  WaitAll(works);
  CHECK(data[0] == std::vector<int64_t>{5 * size});
}

TEST_CASE("float allreduce min and max, of both signs") {
  const int size = GENERATE(1, 2, 3);
  const size_t n = GENERATE(size_t{0}, size_t{1}, size_t{7}, size_t{100003});
  const ReduceOp op = GENERATE(ReduceOp::kMin, ReduceOp::kMax);
  INFO("size " << size << ", n " << n << ", op " << ReduceOpName(op));
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  std::vector<std::vector<float>> data(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    data[r] = FloatData(r, n);
    works.push_back(groups[r]->AllReduce(absl::MakeSpan(data[r]), op));
  }
  WaitAll(works);
  const std::vector<float> expected = ExpectedFloats(op, size, n);
  for (int r = 0; r < size; ++r) CHECK(data[r] == expected);
}

TEST_CASE("reduce_scatter min and max, uneven chunks") {
  const int size = GENERATE(1, 2, 3);
  const size_t n = GENERATE(size_t{2}, size_t{1001});
  const ReduceOp op = GENERATE(ReduceOp::kMin, ReduceOp::kMax);
  INFO("size " << size << ", n " << n << ", op " << ReduceOpName(op));
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  const std::vector<size_t> counts = EvenCounts(n, size);
  std::vector<size_t> offsets(size + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  std::vector<std::vector<float>> inputs(size), outputs(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    inputs[r] = FloatData(r, n);
    outputs[r].assign(counts[r], 1e9f);
    works.push_back(groups[r]->ReduceScatter(inputs[r], absl::MakeSpan(outputs[r]), counts, op));
  }
  WaitAll(works);
  const std::vector<float> expected = ExpectedFloats(op, size, n);
  for (int r = 0; r < size; ++r) {
    CHECK(outputs[r] ==
          std::vector<float>(expected.begin() + offsets[r], expected.begin() + offsets[r + 1]));
  }
}

TEST_CASE("byte broadcast: empty, a few bytes and a few MiB, from every root") {
  const int size = GENERATE(1, 2, 3);
  const size_t n = GENERATE(size_t{0}, size_t{5}, size_t{3} * 1024 * 1024 + 1);
  INFO("size " << size << ", n " << n);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  for (int root = 0; root < size; ++root) {
    INFO("root " << root);
    auto pattern = [&](int rank) {
      std::vector<uint8_t> bytes(n);
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 31 + rank * 101 + 7);
      return bytes;
    };
    std::vector<std::vector<uint8_t>> data(size);
    Works works;
    for (int r = 0; r < size; ++r) {
      data[r] = pattern(r);
      works.push_back(groups[r]->BroadcastBytes(absl::MakeSpan(data[r]), root));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(data[r] == pattern(root));
  }
}

TEST_CASE("typed operations interleave with float ones in issue order") {
  const int size = 3;
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, size);
  std::vector<std::vector<float>> floats(size);
  std::vector<std::vector<int64_t>> ints(size);
  std::vector<std::vector<uint8_t>> bytes(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    floats[r] = FloatData(r, 9);
    ints[r] = IntData(r, 9);
    bytes[r].assign(11, static_cast<uint8_t>(r));
    works.push_back(groups[r]->AllReduce(absl::MakeSpan(floats[r]), ReduceOp::kMax));
    works.push_back(groups[r]->BroadcastBytes(absl::MakeSpan(bytes[r]), 2));
    works.push_back(groups[r]->AllReduceInt64(absl::MakeSpan(ints[r]), ReduceOp::kMin));
    works.push_back(groups[r]->Barrier());
  }
  WaitAll(works);
  for (int r = 0; r < size; ++r) {
    CHECK(floats[r] == ExpectedFloats(ReduceOp::kMax, size, 9));
    CHECK(ints[r] == ExpectedInts(ReduceOp::kMin, size, 9));
    CHECK(bytes[r] == std::vector<uint8_t>(11, 2));
  }
}

TEST_CASE("byte broadcast checks its root like the float one") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 2);
  std::vector<uint8_t> bytes(3);
  CHECK(absl::IsInvalidArgument(groups[0]->BroadcastBytes(absl::MakeSpan(bytes), 2)->Wait()));
  CHECK(absl::IsInvalidArgument(groups[0]->BroadcastBytes(absl::MakeSpan(bytes), -1)->Wait()));
  CHECK(groups[0]->Health().error.ok());
}

}  // namespace
}  // namespace muster::parallel::testing
