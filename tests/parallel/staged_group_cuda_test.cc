// The host-staged ProcessGroup on a real GPU: 2 and 3 ranks as threads of
// one process sharing CUDA device 0, each a Gloo group (group_test_util.h)
// wrapped by CreateHostStagedGroup, on cudaMalloc'd buffers, checked
// exactly (integer-valued floats make sums exact). Needs a GPU: manual,
// built by scripts/test.sh under --config=cuda and run by
// scripts/gpu_run.sh (step `staged`).
#include <cuda_runtime.h>

#include <chrono>
#include <numeric>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "parallel/staged/group.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

using Works = std::vector<std::shared_ptr<Work>>;

#define CUDA_REQUIRE(call)                                  \
  do {                                                      \
    cudaError_t cuda_error_ = (call);                       \
    INFO(#call << ": " << cudaGetErrorString(cuda_error_)); \
    REQUIRE(cuda_error_ == cudaSuccess);                    \
  } while (0)

// n floats of device memory on the current device (device 0).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n_ > 0) CUDA_REQUIRE(cudaMalloc(&data_, n_ * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& values) : DeviceArray(values.size()) {
    Upload(values);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (data_ != nullptr) cudaFree(data_);
  }

  void Upload(const std::vector<T>& values) {
    REQUIRE(values.size() == n_);
    if (n_ > 0) {
      CUDA_REQUIRE(cudaMemcpy(data_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  std::vector<T> Download() const {
    std::vector<T> values(n_);
    if (n_ > 0) {
      CUDA_REQUIRE(cudaMemcpy(values.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return values;
  }
  T* data() { return data_; }
  absl::Span<T> span() { return absl::MakeSpan(data_, n_); }
  size_t size() const { return n_; }

 private:
  size_t n_;
  T* data_ = nullptr;
};
using DeviceBuffer = DeviceArray<float>;

std::vector<std::unique_ptr<DeviceBuffer>> RankBuffers(int size, size_t n) {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  for (int r = 0; r < size; ++r) buffers.push_back(std::make_unique<DeviceBuffer>(RankData(r, n)));
  return buffers;
}

GlooOptions Timeout(absl::Duration timeout) {
  GlooOptions options;
  options.timeout = timeout;
  return options;
}

// Each inner group wrapped; destroy the result before `inner`.
Groups Wrap(Groups& inner, void* compute_stream = nullptr) {
  Groups staged;
  for (size_t r = 0; r < inner.size(); ++r) {
    StagedOptions options;
    options.device = 0;
    options.compute_stream = compute_stream;
    absl::StatusOr<std::unique_ptr<ProcessGroup>> made =
        CreateHostStagedGroup(inner[r].get(), options);
    INFO("rank " << r << ": " << made.status().ToString());
    REQUIRE(made.ok());
    staged.push_back(*std::move(made));
  }
  return staged;
}

std::vector<size_t> Offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

// Lopsided chunks: the first ranks a small share (possibly 0), the last
// the rest.
std::vector<size_t> SkewedCounts(size_t n, int size) {
  std::vector<size_t> counts(size, n / (2 * size));
  counts.back() = n - counts.front() * (size - 1);
  return counts;
}

std::vector<float> Slice(const std::vector<float>& all, size_t begin, size_t end) {
  return std::vector<float>(all.begin() + begin, all.begin() + end);
}

TEST_CASE("collectives on device buffers give exact results") {
  const int size = GENERATE(2, 3);
  const size_t n = GENERATE(size_t{0}, size_t{1}, size_t{6}, size_t{7}, size_t{1000003});
  INFO("size " << size << ", n " << n);
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, size);
  Groups staged = Wrap(inner);
  const std::vector<float> sum = SumOverRanks(size, n);
  std::vector<float> mean = sum;
  for (float& value : mean) value /= static_cast<float>(size);

  SECTION("allreduce sum and avg") {
    auto summed = RankBuffers(size, n);
    auto averaged = RankBuffers(size, n);
    Works works;
    for (int r = 0; r < size; ++r) {
      works.push_back(staged[r]->AllReduce(summed[r]->span(), ReduceOp::kSum));
    }
    for (int r = 0; r < size; ++r) {
      works.push_back(staged[r]->AllReduce(averaged[r]->span(), ReduceOp::kAvg));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) {
      CHECK(summed[r]->Download() == sum);
      CHECK(averaged[r]->Download() == mean);
    }
  }

  SECTION("reduce_scatter sum and avg, even and skewed counts") {
    const ReduceOp op = GENERATE(ReduceOp::kSum, ReduceOp::kAvg);
    const bool skewed = GENERATE(false, true);
    const std::vector<size_t> counts = skewed ? SkewedCounts(n, size) : EvenCounts(n, size);
    const std::vector<size_t> offsets = Offsets(counts);
    auto inputs = RankBuffers(size, n);
    std::vector<std::unique_ptr<DeviceBuffer>> outputs;
    Works works;
    for (int r = 0; r < size; ++r) {
      outputs.push_back(std::make_unique<DeviceBuffer>(std::vector<float>(counts[r], -1.0f)));
      works.push_back(staged[r]->ReduceScatter(inputs[r]->span(), outputs[r]->span(), counts, op));
    }
    WaitAll(works);
    const std::vector<float>& expected = op == ReduceOp::kAvg ? mean : sum;
    for (int r = 0; r < size; ++r) {
      CHECK(outputs[r]->Download() == Slice(expected, offsets[r], offsets[r + 1]));
      CHECK(inputs[r]->Download() == RankData(r, n));  // input untouched
    }
  }

  SECTION("allgather, even and skewed counts") {
    const bool skewed = GENERATE(false, true);
    const std::vector<size_t> counts = skewed ? SkewedCounts(n, size) : EvenCounts(n, size);
    const std::vector<size_t> offsets = Offsets(counts);
    std::vector<std::unique_ptr<DeviceBuffer>> inputs, outputs;
    std::vector<float> expected;
    Works works;
    for (int r = 0; r < size; ++r) {
      std::vector<float> piece = Slice(RankData(r, n), offsets[r], offsets[r + 1]);
      expected.insert(expected.end(), piece.begin(), piece.end());
      inputs.push_back(std::make_unique<DeviceBuffer>(piece));
      outputs.push_back(std::make_unique<DeviceBuffer>(std::vector<float>(n, -1.0f)));
      works.push_back(staged[r]->AllGather(inputs[r]->span(), outputs[r]->span(), counts));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(outputs[r]->Download() == expected);
  }

  SECTION("allgather of bf16 bits, skewed counts: 2-byte elements through the host") {
    const std::vector<size_t> counts = SkewedCounts(n, size);
    std::vector<std::unique_ptr<DeviceArray<uint16_t>>> inputs, outputs;
    std::vector<uint16_t> expected;
    Works works;
    for (int r = 0; r < size; ++r) {
      std::vector<uint16_t> piece;
      for (size_t i = 0; i < counts[r]; ++i) {
        piece.push_back(static_cast<uint16_t>(0x7fc1 ^ (i * 7919 + r)));  // NaN payloads too
      }
      expected.insert(expected.end(), piece.begin(), piece.end());
      inputs.push_back(std::make_unique<DeviceArray<uint16_t>>(piece));
      outputs.push_back(
          std::make_unique<DeviceArray<uint16_t>>(std::vector<uint16_t>(n, uint16_t{0x1234})));
      works.push_back(staged[r]->AllGatherBf16(inputs[r]->span(), outputs[r]->span(), counts));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(outputs[r]->Download() == expected);
  }

  SECTION("broadcast from a non-zero root") {
    const int root = size - 1;
    auto data = RankBuffers(size, n);
    Works works;
    for (int r = 0; r < size; ++r) works.push_back(staged[r]->Broadcast(data[r]->span(), root));
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(data[r]->Download() == RankData(root, n));
  }

  SECTION("host and device buffers mixed in one operation") {
    // reduce_scatter from host input to device output, then allgather from
    // that device output to a host output.
    const std::vector<size_t> counts = EvenCounts(n, size);
    const std::vector<size_t> offsets = Offsets(counts);
    std::vector<std::vector<float>> host_inputs(size), host_outputs(size);
    std::vector<std::unique_ptr<DeviceBuffer>> chunks;
    Works works;
    for (int r = 0; r < size; ++r) {
      host_inputs[r] = RankData(r, n);
      host_outputs[r].assign(n, -1.0f);
      chunks.push_back(std::make_unique<DeviceBuffer>(std::vector<float>(counts[r], -1.0f)));
      works.push_back(
          staged[r]->ReduceScatter(host_inputs[r], chunks[r]->span(), counts, ReduceOp::kSum));
    }
    for (int r = 0; r < size; ++r) {
      works.push_back(
          staged[r]->AllGather(chunks[r]->span(), absl::MakeSpan(host_outputs[r]), counts));
    }
    WaitAll(works);
    for (int r = 0; r < size; ++r) {
      CHECK(chunks[r]->Download() == Slice(sum, offsets[r], offsets[r + 1]));
      CHECK(host_outputs[r] == sum);
    }
  }
}

TEST_CASE("send and recv of device buffers match by source and tag, in order") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 3);
  Groups staged = Wrap(inner);
  DeviceBuffer a(RankData(0, 5)), b(RankData(0, 1000003)), c(RankData(2, 9)), empty_out(0);
  DeviceBuffer got_a(5), got_b(1000003), got_c(9), empty_in(0);
  WaitAll({
      staged[0]->Send(a.span(), 1, /*tag=*/4),
      staged[0]->Send(b.span(), 1, /*tag=*/17),
      staged[2]->Send(c.span(), 1, /*tag=*/4),
      staged[2]->Send(empty_out.span(), 1, /*tag=*/0),
      staged[1]->Recv(got_a.span(), 0, 4),
      staged[1]->Recv(got_b.span(), 0, 17),
      staged[1]->Recv(got_c.span(), 2, 4),
      staged[1]->Recv(empty_in.span(), 2, 0),
  });
  CHECK(got_a.Download() == RankData(0, 5));
  CHECK(got_b.Download() == RankData(0, 1000003));
  CHECK(got_c.Download() == RankData(2, 9));
}

TEST_CASE("a host float passes straight through, barriers and queued operations keep order") {
  const int size = 3;
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, size);
  Groups staged = Wrap(inner);
  std::vector<float> loss = {1.0f, 2.0f, 6.0f};
  const int kRounds = 12;
  const size_t n = 101;
  // buffers[r][k]: round k broadcasts from rank k % size, then sums.
  std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> buffers(size);
  Works works;
  for (int r = 0; r < size; ++r) {
    works.push_back(staged[r]->AllReduce(absl::MakeSpan(&loss[r], 1), ReduceOp::kAvg));
  }
  for (int k = 0; k < kRounds; ++k) {
    for (int r = 0; r < size; ++r) {
      buffers[r].push_back(std::make_unique<DeviceBuffer>(RankData(r + k, n)));
      works.push_back(staged[r]->Broadcast(buffers[r][k]->span(), k % size));
      works.push_back(staged[r]->AllReduce(buffers[r][k]->span(), ReduceOp::kSum));
      if (k % 4 == 0) works.push_back(staged[r]->Barrier());
    }
  }
  WaitAll(works);
  CHECK(loss == std::vector<float>(size, 3.0f));
  for (int k = 0; k < kRounds; ++k) {
    std::vector<float> expected = RankData(k % size + k, n);
    for (float& value : expected) value *= size;
    for (int r = 0; r < size; ++r) CHECK(buffers[r][k]->Download() == expected);
  }
  for (int r = 0; r < size; ++r) {
    GroupHealth health = staged[r]->Health();
    CHECK(health.error.ok());
  }
}

// Holds the stream up (a host function enqueued on it), so the writes after
// it land late: the delay is the condition under test, not a wait.
void CUDART_CB SleepOnStream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(milliseconds)));
}

TEST_CASE("an operation sees what the compute stream wrote before it was issued") {
  const bool own_stream = GENERATE(false, true);
  INFO((own_stream ? "a stream of its own" : "the legacy default stream"));
  const int size = 2;
  const size_t n = size_t{1} << 18;
  cudaStream_t stream = nullptr;  // the legacy default stream
  if (own_stream) CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, size);
  Groups staged = Wrap(inner, stream);
  static int sleep_ms = 300;  // the host function holds the stream this long

  SECTION("the copy to host waits for an earlier write") {
    // Pinned sources, so cudaMemcpyAsync returns before copying.
    std::vector<float*> sources(size, nullptr);
    auto buffers = RankBuffers(size, n);
    std::vector<float> expected(n, 0.0f);
    Works works;
    for (int r = 0; r < size; ++r) {
      CUDA_REQUIRE(cudaMallocHost(&sources[r], n * sizeof(float)));
      std::vector<float> values = RankData(r + 10, n);
      std::copy(values.begin(), values.end(), sources[r]);
      for (size_t i = 0; i < n; ++i) expected[i] += values[i];
    }
    for (int r = 0; r < size; ++r) {
      CUDA_REQUIRE(cudaLaunchHostFunc(stream, SleepOnStream, &sleep_ms));
      CUDA_REQUIRE(cudaMemcpyAsync(buffers[r]->data(), sources[r], n * sizeof(float),
                                   cudaMemcpyHostToDevice, stream));
      works.push_back(staged[r]->AllReduce(buffers[r]->span(), ReduceOp::kSum));
    }
    // Issued while the writes were still held up: the test means something.
    CHECK(cudaStreamQuery(stream) == cudaErrorNotReady);
    WaitAll(works);
    for (int r = 0; r < size; ++r) CHECK(buffers[r]->Download() == expected);
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    for (float* source : sources) CUDA_REQUIRE(cudaFreeHost(source));
  }

  SECTION("the copy back waits for an earlier read") {
    // Rank 1 snapshots its buffer on the compute stream, late; the
    // broadcast into that buffer must not land before the snapshot.
    auto buffers = RankBuffers(size, n);
    DeviceBuffer snapshot(n);
    CUDA_REQUIRE(cudaLaunchHostFunc(stream, SleepOnStream, &sleep_ms));
    CUDA_REQUIRE(cudaMemcpyAsync(snapshot.data(), buffers[1]->data(), n * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream));
    Works works;
    for (int r = 0; r < size; ++r) works.push_back(staged[r]->Broadcast(buffers[r]->span(), 0));
    CHECK(cudaStreamQuery(stream) == cudaErrorNotReady);
    WaitAll(works);
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    CHECK(snapshot.Download() == RankData(1, n));
    CHECK(buffers[1]->Download() == RankData(0, n));
  }

  staged.clear();
  if (stream != nullptr) CUDA_REQUIRE(cudaStreamDestroy(stream));
}

TEST_CASE("bad arguments fail at once with INVALID_ARGUMENT and leave the group usable") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 2);
  Groups staged = Wrap(inner);
  DeviceBuffer data(std::vector<float>(4, 1.0f)), out(2);
  CHECK(staged[0]->ReduceScatter(data.span(), out.span(), {2}, ReduceOp::kSum)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->ReduceScatter(data.span(), out.span(), {1, 1}, ReduceOp::kSum)->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->AllGather(data.span(), out.span(), {2, 2})->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  DeviceArray<uint16_t> halves(std::vector<uint16_t>(4, 1)), halves_out(2);
  CHECK(staged[0]->AllGatherBf16(halves.span(), halves_out.span(), {2, 2})->Wait().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->Broadcast(data.span(), 2)->Wait().code() == absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->Send(data.span(), 0, 1)->Wait().code() == absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->Recv(data.span(), 1, -1)->Wait().code() == absl::StatusCode::kInvalidArgument);
  CHECK(staged[0]->Health().error.ok());
  DeviceBuffer other(std::vector<float>(4, 2.0f));
  WaitAll({staged[0]->AllReduce(data.span(), ReduceOp::kSum),
           staged[1]->AllReduce(other.span(), ReduceOp::kSum)});
  CHECK(data.Download() == std::vector<float>(4, 3.0f));
}

TEST_CASE("Abort fails the rank's work with the cause at once, and frees its peer") {
  const absl::Duration timeout = absl::Seconds(30);
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 2, Timeout(timeout));
  Groups staged = Wrap(inner);
  CHECK(staged[0]->timeout() == timeout + kCopyMargin);
  DeviceBuffer a0(RankData(0, 1000)), b0(RankData(0, 1000)), a1(RankData(1, 1000));
  // Receives nobody sends: rank 1's is pending on rank 0; rank 0's runs,
  // with an allreduce queued behind it.
  auto pending1 = staged[1]->Recv(a1.span(), 0, /*tag=*/5);
  auto running0 = staged[0]->Recv(a0.span(), 1, /*tag=*/6);
  auto queued0 = staged[0]->AllReduce(b0.span(), ReduceOp::kSum);
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(!running0->Done());
  REQUIRE(!pending1->Done());
  GroupHealth running = staged[0]->Health();
  CHECK(running.error.ok());
  CHECK(absl::StrContains(running.running, "recv"));
  CHECK(running.running_since.has_value());

  const absl::Status cause = absl::AbortedError("watchdog: the rendezvous round ended");
  const absl::Time start = absl::Now();
  staged[0]->Abort(cause);
  absl::Status running_status = running0->Wait();
  absl::Status queued_status = queued0->Wait();
  const absl::Duration local = absl::Now() - start;
  absl::Status peer_status = pending1->Wait();
  const absl::Duration peer = absl::Now() - start;
  INFO(running_status.ToString() << "\n"
                                 << queued_status.ToString() << "\n"
                                 << peer_status.ToString() << "\nlocal "
                                 << absl::FormatDuration(local) << ", peer "
                                 << absl::FormatDuration(peer));
  for (const absl::Status& status : {running_status, queued_status}) {
    CHECK(status.code() == absl::StatusCode::kAborted);
    CHECK(absl::StrContains(status.message(), "the rendezvous round ended"));
  }
  CHECK(local < absl::Seconds(1));
  CHECK(!peer_status.ok());
  CHECK(peer < absl::Seconds(5));  // well under the 30 s (+30 s) timeout
  CHECK(staged[0]->Health().error.code() == absl::StatusCode::kAborted);
  CHECK(!staged[1]->Health().error.ok());
  // Sticky: later work fails at once with the cause.
  CHECK(staged[0]->Barrier()->Wait().code() == absl::StatusCode::kAborted);
}

TEST_CASE("Health reports the inner group's error while the staged queue is idle") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 2, Timeout(absl::Seconds(30)));
  Groups staged = Wrap(inner);
  DeviceBuffer data(RankData(0, 10)), other(RankData(1, 10));
  WaitAll({staged[0]->AllReduce(data.span(), ReduceOp::kSum),
           staged[1]->AllReduce(other.span(), ReduceOp::kSum)});
  CHECK(staged[0]->Health().error.ok());
  // Rank 1 leaves; rank 0's inner group notices (its monitor), not the
  // staged queue, which has nothing to run.
  staged[1].reset();
  inner[1].reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (staged[0]->Health().error.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::Status error = staged[0]->Health().error;
  INFO(error.ToString());
  CHECK(error.code() == absl::StatusCode::kUnavailable);
  CHECK(staged[0]->AllReduce(data.span(), ReduceOp::kSum)->Wait().code() ==
        absl::StatusCode::kUnavailable);
}

TEST_CASE("int64 and byte operations take host memory, in order with device ones") {
  const int size = GENERATE(2, 3);
  const size_t n = 1001;
  INFO("size " << size);
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, size);
  Groups staged = Wrap(inner);
  auto device = RankBuffers(size, n);
  std::vector<std::vector<int64_t>> ints(size);
  std::vector<std::vector<uint8_t>> bytes(size);
  const int64_t big = int64_t{1} << 60;
  Works works;
  for (int r = 0; r < size; ++r) {
    ints[r] = {big + r, -big * (r + 1)};
    bytes[r].assign(3 * 1024 * 1024 + 5, static_cast<uint8_t>(r + 1));
    // Device, host, host, device: inner must see them in this order.
    works.push_back(staged[r]->AllReduce(device[r]->span(), ReduceOp::kMax));
    works.push_back(staged[r]->AllReduceInt64(absl::MakeSpan(ints[r]), ReduceOp::kMin));
    works.push_back(staged[r]->BroadcastBytes(absl::MakeSpan(bytes[r]), size - 1));
    works.push_back(staged[r]->AllReduce(device[r]->span(), ReduceOp::kSum));
  }
  WaitAll(works);
  std::vector<float> expected = RankData(size - 1, n);  // the max: the last rank's
  for (float& value : expected) value *= size;
  for (int r = 0; r < size; ++r) {
    CHECK(device[r]->Download() == expected);
    CHECK(ints[r] == std::vector<int64_t>{big, -big * size});
    CHECK(bytes[r] == std::vector<uint8_t>(3 * 1024 * 1024 + 5, static_cast<uint8_t>(size)));
  }
}

TEST_CASE("int64 and byte operations on device memory are INVALID_ARGUMENT, group intact") {
  rdzv::InMemoryStore store;
  Groups inner = ConnectGroups(store, 1);
  Groups staged = Wrap(inner);
  int64_t* ints = nullptr;
  CUDA_REQUIRE(cudaMalloc(&ints, 4 * sizeof(int64_t)));
  absl::Status status = staged[0]->AllReduceInt64(absl::MakeSpan(ints, 4), ReduceOp::kSum)->Wait();
  INFO(status.ToString());
  CHECK(absl::IsInvalidArgument(status));
  CHECK(absl::StrContains(status.message(), "host memory"));
  status =
      staged[0]
          ->BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(ints), 4 * sizeof(int64_t)), 0)
          ->Wait();
  CHECK(absl::IsInvalidArgument(status));
  cudaFree(ints);
  CHECK(absl::IsInvalidArgument(
      staged[0]->AllReduceInt64(absl::Span<int64_t>(), ReduceOp::kAvg)->Wait()));
  std::vector<int64_t> host = {7};
  WaitAll({staged[0]->AllReduceInt64(absl::MakeSpan(host), ReduceOp::kMax)});
  CHECK(host == std::vector<int64_t>{7});
  CHECK(staged[0]->Health().error.ok());
}

}  // namespace
}  // namespace muster::parallel::testing
