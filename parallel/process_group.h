// Collective communication among the ranks of one job round: the one
// interface DDP (and later FSDP and pipeline parallelism) talk through.
// Back ends: Gloo over TCP (parallel/gloo/group.h, CPU memory), NCCL
// (parallel/nccl/group.h, device memory, --config=cuda only), Gloo staged
// through pinned memory (parallel/staged/group.h) and a group of one rank
// (parallel/self_group.h). Blocking control-plane calls over a host-memory
// group: parallel/collectives.h.
//
// Ordering. Operations run asynchronously, one at a time, in the order
// they were issued. Every rank must issue the same collectives in the same
// order (as with NCCL); send/recv pairs must match in order too. Issuing
// returns at once with a Work handle; the buffers must stay valid and
// untouched until that Work has finished.
//
// Timeouts. Every operation is bounded by the group's timeout, counted from
// when it starts running. Work::Wait() waits at most until that operation's
// deadline plus the time the operations queued before it may take.
//
// Errors, as the status of a Work:
//   UNAVAILABLE        a peer closed its connection (it died or left)
//   DEADLINE_EXCEEDED  the operation's timeout passed
//   INVALID_ARGUMENT   bad sizes, ranks or ops, or memory of the wrong kind
//                      (reported without communicating; the group stays usable)
//   INTERNAL           anything else from the back end
// After a communication error the group is broken for good: the running
// operation, everything queued behind it and everything issued later fail
// with the first error: no retry in place. The job's restart takes over.
//
// Names in messages. A rank belongs to several groups at once (the world,
// its pipeline and data-parallel sub-groups), and a group rank means
// nothing in a log without its group: messages name the group
// (GroupMembers::name, "world" for the world group) and every process by
// its GLOBAL rank, with its rank in the group beside it, all on one line:
//   recv of 1024 floats with tag 0 from global rank 2 (rank 1 of group
//   act.pp.0.0; op #19 on global rank 0): connection to global rank 2
//   (rank 1 of group act.pp.0.0) at [10.0.0.3]:41234 failed (...): ...
// An operation's arguments (a root, a peer, counts) stay group ranks.
//
// Thread-safety: a ProcessGroup may be used from several threads, but the
// ORDER of issue must be the same on every rank, which in practice means
// one thread issues (the training thread, or DDP's backward callback on
// it). Work handles may be waited on from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace muster::parallel {

// kAvg is the sum divided by size(); it exists for floats only.
enum class ReduceOp { kSum, kAvg, kMin, kMax };

// "sum", "avg", "min", "max": for messages.
const char* ReduceOpName(ReduceOp op);

// One issued operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation has finished (or failed) and returns its
  // status. Bounded: see "Timeouts" above.
  virtual absl::Status Wait() = 0;
  // Whether it has finished, without blocking.
  virtual bool Done() const = 0;
};

// Whom a group's messages name: the group, and its members' global ranks.
struct GroupMembers {
  // "world" for the world group; a sub-group's name otherwise, as
  // Communicator::NewGroup was given it ("dp_shard.1", "act.pp.0.0").
  std::string name = "world";
  // global_ranks[r] is group rank r's global rank, in group-rank order;
  // empty: group rank r is global rank r (the world group).
  std::vector<int> global_ranks;

  // Group rank -> global rank (the rank itself when the list does not
  // cover it: an argument not checked yet).
  int Global(int rank) const;
  // "global rank 2 (rank 1 of group act.pp.0.0)".
  std::string Peer(int rank) const;
  // An operation's description, which its errors begin with. With a peer
  // (peer >= 0), `what` ends with the word before it ("from", "to"):
  //   "recv of 8 floats from global rank 2 (rank 1 of group act.pp.0.0;
  //    op #19 on global rank 0)"
  // without one (peer < 0), a collective of the whole group:
  //   "allreduce (sum) of 8 floats (group dp_shard.1 of 2 ranks; op #5 on
  //    global rank 2)"
  // `op` < 0 leaves out "op #N " (a back end that does not number them);
  // `rank` is this process's group rank, `size` the group's.
  std::string Describe(const std::string& what, int peer, int64_t op, int rank, int size) const;
};

// INVALID_ARGUMENT unless `members` can name a group of `size` ranks: a
// name, and global_ranks empty or `size` distinct ranks >= 0. `who` (e.g.
// "CreateGlooGroup") begins the message.
absl::Status CheckMembers(const char* who, const GroupMembers& members, int size);

// What a watchdog (parallel/watchdog.h) sees of a group.
struct GroupHealth {
  absl::Status error;                       // the sticky first error; OK if none
  std::optional<absl::Time> running_since;  // when the running operation started
  std::string running;                      // its description ("" when idle)
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual absl::Duration timeout() const = 0;
  // The group's name and its members' global ranks, as its messages name
  // them (GroupMembers). The default is the world's: "world", and group
  // rank r is global rank r.
  virtual GroupMembers members() const { return {}; }

  // Whether the group's operations take host memory: Gloo and self groups
  // do, and a staged group does for the operations a device buffer cannot
  // use (it stages device buffers for the others). NCCL takes device
  // memory only, and a host pointer in its kernels is an illegal address
  // or silent garbage, not an error; so code that passes host memory (the
  // control plane, collectives.h) asks first.
  virtual bool takes_host_memory() const { return true; }

  // In place: every rank's `data` becomes the element-wise sum, mean,
  // minimum or maximum over ranks. Every rank passes the same length (may
  // be 0).
  virtual std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) = 0;

  // The same on 64-bit integers, exactly (a sum wraps modulo 2^64 on
  // overflow): kSum, kMin, kMax. kAvg is INVALID_ARGUMENT, reported without
  // communicating. For counts, steps and votes, which floats only
  // approximate above 2^24.
  virtual std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) = 0;

  // `input` is split into size() consecutive chunks of counts[0],
  // counts[1], ... elements (counts.size() == size(), sum == input.size());
  // rank r receives the reduction (any ReduceOp) of every rank's chunk r in
  // `output` (output.size() == counts[rank]). Counts may differ and may be 0.
  virtual std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input,
                                              absl::Span<float> output, std::vector<size_t> counts,
                                              ReduceOp op) = 0;

  // Every rank contributes `input` (counts[rank] elements); `output` (sum of
  // counts) becomes the concatenation in rank order on every rank.
  virtual std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                          std::vector<size_t> counts) = 0;

  // AllGather on 16-bit elements: raw bf16 bits, moved and never computed
  // on (FSDP gathers parameters in bf16, half the bytes of fp32). The same
  // counts, memory kind and errors as AllGather.
  virtual std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input,
                                              absl::Span<uint16_t> output,
                                              std::vector<size_t> counts) = 0;

  // Every rank's `data` becomes root's.
  virtual std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) = 0;

  // The same on raw bytes (every rank passes the same length, which may
  // be 0): serialized messages, names, paths. Collectives::Broadcast
  // (parallel/collectives.h) sends a string whose length only root knows.
  virtual std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) = 0;

  // Point to point. `tag` tells apart several messages in flight between
  // the same pair; a Recv matches the Send with the same tag from `source`,
  // and the two must have the same length.
  virtual std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) = 0;
  virtual std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) = 0;

  // Finishes when every rank has reached it.
  virtual std::shared_ptr<Work> Barrier() = 0;

  // Thread-safe, cheap: the first error and the running operation.
  virtual GroupHealth Health() const = 0;

  // Breaks the group for good, from any thread (a watchdog's): the running
  // operation, everything queued and everything issued later fail with
  // `cause`, and their waiters return at once. Peers blocked on this rank
  // are freed too: Gloo closes its connections, NCCL aborts its
  // communicator (ncclCommAbort). A group that has already failed keeps
  // its first error.
  virtual void Abort(const absl::Status& cause) = 0;
};

// The chunk sizes that split `total` elements as evenly as possible over
// `parts` ranks: the first total % parts chunks get one more element.
std::vector<size_t> EvenCounts(size_t total, int parts);

// The argument checks every back end makes at issue time (INVALID_ARGUMENT,
// without communicating), for rank `rank` of `size`:
//   counts: one per rank, summing to `total`, with counts[rank] == `mine`;
//   a peer in [0, size), and not this rank unless `self_ok`;
//   point to point: that, and a tag >= 0.
// `op` / `what` name the argument in the message.
absl::Status CheckCounts(const char* op, const std::vector<size_t>& counts, size_t total,
                         size_t mine, int rank, int size);
absl::Status CheckPeer(const char* what, int peer, bool self_ok, int rank, int size);
absl::Status CheckPointToPoint(const char* what, int peer, int tag, int rank, int size);
// AllReduceInt64's op: INVALID_ARGUMENT for kAvg (an integer mean would
// have to round, and no caller needs one).
absl::Status CheckInt64Op(ReduceOp op);

}  // namespace muster::parallel
