#include "parallel/gloo/ops.h"

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <numeric>

#include <typeinfo>

// Debian's libgloo-dev ships gloo/transport/tcp/pair.h without the
// gloo/common/memory.h it includes, so that header cannot be compiled. The
// probe needs one non-virtual member of tcp::Pair: declare just that (same
// mangled name as in libgloo). Nothing here touches the class's layout.
namespace gloo::transport::tcp {
class Pair {
 public:
  bool tryRecv(::gloo::transport::UnboundBuffer* buffer, uint64_t slot, size_t offset,
               size_t nbytes);
};
}  // namespace gloo::transport::tcp

namespace muster::parallel::gloo_ops {
namespace {

// gloo's reduce functions: out[i] = a[i] op b[i]. gloo calls them with
// out == a; element i reads only inputs i, so the loops vectorize all the
// same.
template <typename T>
void Sum(void* out, const void* a, const void* b, size_t n) {
  T* c = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) c[i] = x[i] + y[i];
}

// Signed overflow is undefined; unsigned arithmetic wraps, and converting
// back is modular since C++20 (and with g++ in every standard).
template <>
void Sum<int64_t>(void* out, const void* a, const void* b, size_t n) {
  int64_t* c = static_cast<int64_t*>(out);
  const int64_t* x = static_cast<const int64_t*>(a);
  const int64_t* y = static_cast<const int64_t*>(b);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    c[i] = static_cast<int64_t>(static_cast<uint64_t>(x[i]) + static_cast<uint64_t>(y[i]));
  }
}

template <typename T>
void Min(void* out, const void* a, const void* b, size_t n) {
  T* c = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) c[i] = y[i] < x[i] ? y[i] : x[i];
}

template <typename T>
void Max(void* out, const void* a, const void* b, size_t n) {
  T* c = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) c[i] = y[i] > x[i] ? y[i] : x[i];
}

using ReduceFunction = void (*)(void*, const void*, const void*, size_t);

template <typename T>
ReduceFunction FunctionFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return &Min<T>;
    case ReduceOp::kMax:
      return &Max<T>;
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // the caller divides
      break;
  }
  return &Sum<T>;
}

template <typename T>
void RingAllReduce(const std::shared_ptr<gloo::Context>& context, absl::Span<T> data, ReduceOp op,
                   uint32_t tag, Millis timeout) {
  gloo::AllreduceOptions options(context);
  options.setOutput(data.data(), data.size());
  options.setReduceFunction(FunctionFor<T>(op));
  options.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  options.setTag(tag);
  options.setTimeout(timeout);
  gloo::allreduce(options);
}

template <typename T>
void BroadcastFrom(const std::shared_ptr<gloo::Context>& context, absl::Span<T> data, int root,
                   uint32_t tag, Millis timeout) {
  gloo::BroadcastOptions options(context);
  options.setOutput(data.data(), data.size());
  options.setRoot(root);
  options.setTag(tag);
  options.setTimeout(timeout);
  gloo::broadcast(options);
}

// gloo reads inputs through non-const pointers but never writes them.
float* Mutable(absl::Span<const float> data) { return const_cast<float*>(data.data()); }

// waitSend/waitRecv return false only when aborted, which we never do;
// treat it as a broken connection all the same.
void Check(bool completed, const char* what) {
  if (!completed) throw gloo::IoException(std::string(what) + " was aborted");
}

}  // namespace

void AllReduce(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, ReduceOp op,
               uint32_t tag, Millis timeout) {
  RingAllReduce(context, data, op, tag, timeout);
}

void AllReduce(const std::shared_ptr<gloo::Context>& context, absl::Span<int64_t> data, ReduceOp op,
               uint32_t tag, Millis timeout) {
  RingAllReduce(context, data, op, tag, timeout);
}

namespace {

// gloo::allgatherv moves elements of any type without looking at them.
template <typename T>
void AllGatherOf(const std::shared_ptr<gloo::Context>& context, absl::Span<const T> input,
                 absl::Span<T> output, const std::vector<size_t>& counts, uint32_t tag,
                 Millis timeout) {
  gloo::AllgathervOptions options(context);
  options.setInput(const_cast<T*>(input.data()), input.size());
  options.setOutput(output.data(), counts);
  options.setTag(tag);
  options.setTimeout(timeout);
  gloo::allgatherv(options);
}

}  // namespace

void AllGather(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> input,
               absl::Span<float> output, const std::vector<size_t>& counts, uint32_t tag,
               Millis timeout) {
  AllGatherOf(context, input, output, counts, tag, timeout);
}

void AllGather(const std::shared_ptr<gloo::Context>& context, absl::Span<const uint16_t> input,
               absl::Span<uint16_t> output, const std::vector<size_t>& counts, uint32_t tag,
               Millis timeout) {
  AllGatherOf(context, input, output, counts, tag, timeout);
}

void Broadcast(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, int root,
               uint32_t tag, Millis timeout) {
  BroadcastFrom(context, data, root, tag, timeout);
}

void Broadcast(const std::shared_ptr<gloo::Context>& context, absl::Span<uint8_t> data, int root,
               uint32_t tag, Millis timeout) {
  BroadcastFrom(context, data, root, tag, timeout);
}

void Barrier(const std::shared_ptr<gloo::Context>& context, uint32_t tag, Millis timeout) {
  gloo::BarrierOptions options(context);
  options.setTag(tag);
  options.setTimeout(timeout);
  gloo::barrier(options);
}

void Send(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> data,
          int destination, uint32_t tag, Millis timeout) {
  auto buffer = context->createUnboundBuffer(Mutable(data), data.size() * sizeof(float));
  buffer->send(destination, gloo::Slot::build(kSendRecvSlotPrefix, tag));
  Check(buffer->waitSend(timeout), "send");
}

void Recv(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, int source,
          uint32_t tag, Millis timeout) {
  auto buffer = context->createUnboundBuffer(data.data(), data.size() * sizeof(float));
  buffer->recv(source, gloo::Slot::build(kSendRecvSlotPrefix, tag));
  Check(buffer->waitRecv(timeout), "recv");
}

void ProbeConnection(gloo::Context& context, int peer) {
  if (peer == context.rank) return;
  std::unique_ptr<gloo::transport::Pair>& pair = context.getPair(peer);
  // tcp::Pair's first base is transport::Pair (it has a vtable, so it is
  // the primary base at offset 0): the pointer converts without adjusting.
  if (pair == nullptr || std::string(typeid(*pair).name()) != "N4gloo9transport3tcp4PairE") {
    return;
  }
  static char unused;
  auto probe = context.createUnboundBuffer(&unused, 0);
  // tryRecv throws the pair's error if it has one; on a slot nothing ever
  // sends to, it otherwise returns false without posting anything.
  reinterpret_cast<gloo::transport::tcp::Pair*>(pair.get())
      ->tryRecv(probe.get(), gloo::Slot::build(kProbeSlotPrefix, 0), 0, 0);
}

// gloo (this version) has no options-style reduce_scatter. Its only one is
// the old bound-buffer ReduceScatterHalvingDoubling: an Algorithm object
// whose constructor registers per-pair buffers for one fixed pointer (a
// handshake per call), works in place on the whole input and has no
// timeout per call. A ring on unbound buffers handles any counts
// (zeros included) and moves each element once per step: P-1 steps, in step
// s rank r sends its running sum of chunk (r-s-1) to r+1 and receives the
// running sum of chunk (r-s-2) from r-1, which it adds its own input to, so
// after P-1 steps it holds the full sum of chunk r (or its min, or max: any
// associative, commutative op). The chunk summed in step s is the one sent
// in step s+1, so the running sums live in two chunk-sized buffers used in
// turn (step 0 sends straight from the input, the last step sums into the
// output): no copy of the whole input, which for FSDP's largest stage, the
// tied embedding, is as big as the stage. Chunks are matched by order on one
// slot: a pair's messages on a slot are delivered in the order posted.
void ReduceScatter(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> input,
                   absl::Span<float> output, const std::vector<size_t>& counts, ReduceOp op,
                   uint32_t tag, Millis timeout) {
  const int P = context->size;
  const int r = context->rank;
  std::vector<size_t> offsets(P + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  if (P == 1 || input.empty()) {
    std::copy_n(input.begin() + offsets[r], counts[r], output.begin());
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(
        Millis(1), std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now()));
  };
  const size_t largest = *std::max_element(counts.begin(), counts.end());
  // (largest count each; one when P is 2). Not zeroed: every chunk is
  // received in full before it is read.
  std::unique_ptr<float[]> running[2];
  std::unique_ptr<gloo::transport::UnboundBuffer> running_buffer[2];
  for (int b = 0; b < std::min(2, P - 1); ++b) {
    running[b].reset(new float[largest]);
    running_buffer[b] = context->createUnboundBuffer(running[b].get(), largest * sizeof(float));
  }
  auto input_buffer = context->createUnboundBuffer(Mutable(input), input.size() * sizeof(float));
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  const ReduceFunction combine = FunctionFor<float>(op);
  const int next = (r + 1) % P;
  const int prev = (r + P - 1) % P;
  for (int step = 0; step < P - 1; ++step) {
    const int send_chunk = (r - step - 1 + 2 * P) % P;
    const int recv_chunk = (r - step - 2 + 2 * P) % P;
    const size_t send_bytes = counts[send_chunk] * sizeof(float);
    const size_t recv_bytes = counts[recv_chunk] * sizeof(float);
    gloo::transport::UnboundBuffer* receive = running_buffer[step % 2].get();
    float* received = running[step % 2].get();
    // Step 0 sends this rank's own input; later steps the sum made in the
    // step before, in the other buffer.
    gloo::transport::UnboundBuffer* send =
        step == 0 ? input_buffer.get() : running_buffer[(step - 1) % 2].get();
    const size_t send_offset = step == 0 ? offsets[send_chunk] * sizeof(float) : 0;
    // Post the receive before the send: the transport sends only into a
    // posted receive, so every rank sending first would deadlock.
    if (recv_bytes > 0) receive->recv(prev, slot, 0, recv_bytes);
    if (send_bytes > 0) send->send(next, slot, send_offset, send_bytes);
    if (recv_bytes > 0) {
      Check(receive->waitRecv(left()), "reduce_scatter recv");
      float* sum = step == P - 2 ? output.data() : received;
      combine(sum, input.data() + offsets[recv_chunk], received, counts[recv_chunk]);
    }
    // The next step receives into the buffer this one sent from.
    if (send_bytes > 0) Check(send->waitSend(left()), "reduce_scatter send");
  }
}

}  // namespace muster::parallel::gloo_ops
