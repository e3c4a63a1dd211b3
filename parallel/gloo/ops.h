// The bodies of GlooGroup's operations: blocking gloo calls on one
// context, run on the group's communication thread. Internal to
// parallel/gloo/group.cc (not a public header).
//
// Every function throws what gloo throws (gloo::IoException on a broken
// connection or a timeout, gloo::EnforceNotMet on misuse); GlooGroup maps
// those to Status. Sizes are validated by the caller. `timeout` is the time
// left until the operation's deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include <gloo/context.h>

#include "absl/types/span.h"
#include "parallel/process_group.h"

namespace muster::parallel::gloo_ops {

using Millis = std::chrono::milliseconds;

// Slot prefixes for the operations built on unbound buffers. gloo's own
// collectives use prefixes 0x01..0x08 (gloo/types.h); ours sit above them.
inline constexpr uint8_t kSendRecvSlotPrefix = 0x40;
inline constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
// Never carries data: GlooGroup probes its pairs' health on it.
inline constexpr uint8_t kProbeSlotPrefix = 0x42;

// The reductions take a ReduceOp; kAvg reduces as kSum (the caller divides).
// Min and max of floats are `b < a ? b : a` and `b > a ? b : a` element-wise.

void AllReduce(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, ReduceOp op,
               uint32_t tag, Millis timeout);
// Exact; the sum wraps modulo 2^64.
void AllReduce(const std::shared_ptr<gloo::Context>& context, absl::Span<int64_t> data, ReduceOp op,
               uint32_t tag, Millis timeout);

// Rank r contributes input (counts[r] elements); output holds all in order.
void AllGather(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> input,
               absl::Span<float> output, const std::vector<size_t>& counts, uint32_t tag,
               Millis timeout);
void AllGather(const std::shared_ptr<gloo::Context>& context, absl::Span<const uint16_t> input,
               absl::Span<uint16_t> output, const std::vector<size_t>& counts, uint32_t tag,
               Millis timeout);

void Broadcast(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, int root,
               uint32_t tag, Millis timeout);
void Broadcast(const std::shared_ptr<gloo::Context>& context, absl::Span<uint8_t> data, int root,
               uint32_t tag, Millis timeout);

void Barrier(const std::shared_ptr<gloo::Context>& context, uint32_t tag, Millis timeout);

// Point to point on slot (kSendRecvSlotPrefix, user tag).
void Send(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> data,
          int destination, uint32_t tag, Millis timeout);
void Recv(const std::shared_ptr<gloo::Context>& context, absl::Span<float> data, int source,
          uint32_t tag, Millis timeout);

// Throws the connection's error if the tcp pair to `peer` has failed;
// otherwise does nothing (no data moves). No-op for `peer` == own rank.
void ProbeConnection(gloo::Context& context, int peer);

// The reduction of every rank's chunk `rank` of `input` (chunks of
// counts[i] floats) into `output`.
void ReduceScatter(const std::shared_ptr<gloo::Context>& context, absl::Span<const float> input,
                   absl::Span<float> output, const std::vector<size_t>& counts, ReduceOp op,
                   uint32_t tag, Millis timeout);

}  // namespace muster::parallel::gloo_ops
