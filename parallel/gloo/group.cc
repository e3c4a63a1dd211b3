#include "parallel/gloo/group.h"

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <signal.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "parallel/gloo/ops.h"
#include "parallel/gloo/store.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

using gloo_ops::Millis;

Millis ToMillis(absl::Duration duration) {
  return Millis(std::max<int64_t>(1, absl::ToInt64Milliseconds(duration)));
}

// tcp addresses print as "[ip]:port$seq"; the sequence number tells pairs
// apart on one listener and is noise for naming a peer.
std::string WithoutSequence(std::string address) { return address.substr(0, address.find('$')); }

// What a running operation needs, shared with it: a stuck operation may
// outlive its GlooGroup (see WorkQueue's destructor).
struct Shared {
  std::shared_ptr<gloo::rendezvous::Context> context;
  // peer_addresses[r]: group rank r's listening address (may be empty).
  std::vector<std::string> peer_addresses;
  absl::Duration timeout;
  GroupMembers members;
};

// What a gloo exception message means, as process_group.h's codes, naming
// the peer by global rank and group rank (process_group.h, "Names in
// messages") when the message or the group's shape tells which it is.
absl::Status StatusFromGlooError(absl::string_view message, const Shared& shared) {
  std::string lower = absl::AsciiStrToLower(message);
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(
        absl::StrCat("timed out (timeout ", absl::FormatDuration(shared.timeout), "): ", message));
  }
  // The side of a pair that accepted the connection knows its peer only by
  // the peer's ephemeral port, so not every message names an address.
  const std::vector<std::string>& addresses = shared.peer_addresses;
  for (size_t peer = 0; peer < addresses.size(); ++peer) {
    if (!addresses[peer].empty() && absl::StrContains(message, addresses[peer])) {
      return absl::UnavailableError(absl::StrCat(
          "connection to ", shared.members.Peer(static_cast<int>(peer)), " at ", addresses[peer],
          " failed (that process died or closed the group): ", message));
    }
  }
  // Two ranks have one connection: it is the other rank's.
  const int size = shared.context != nullptr ? shared.context->size : 0;
  if (size == 2) {
    return absl::UnavailableError(
        absl::StrCat("connection to ", shared.members.Peer(1 - shared.context->rank),
                     " failed (that process died or closed the group): ", message));
  }
  return absl::UnavailableError(absl::StrCat("a peer connection in group ", shared.members.name,
                                             " failed (a peer process died or closed "
                                             "the group): ",
                                             message));
}

// Runs gloo calls, mapping what they throw to process_group.h's codes.
absl::Status RunGloo(const Shared& shared, const std::function<void()>& body) {
  try {
    body();
    return absl::OkStatus();
  } catch (const gloo::IoException& error) {
    return StatusFromGlooError(error.what(), shared);
  } catch (const gloo::EnforceNotMet& error) {
    return absl::InternalError(absl::StrCat("gloo: ", error.what()));
  } catch (const std::exception& error) {
    return absl::InternalError(absl::StrCat("gloo: ", error.what()));
  }
}

// Broken for good: closing our end makes the peers blocked on us fail now
// rather than after their timeout.
void CloseConnections(const Shared& shared) {
  try {
    shared.context->closeConnections();
  } catch (const std::exception&) {
    // Already broken; the first error is what the caller needs.
  }
}

// data /= ranks. With a power of two, as multiplication by the inverse:
// the same floats (both round the same real number), and a divide per
// element was a third of the communication thread's time at 2 ranks.
void Scale(absl::Span<float> data, int ranks) {
  float* values = data.data();
  const long count = static_cast<long>(data.size());
  const float divisor = static_cast<float>(ranks);
  if ((ranks & (ranks - 1)) == 0) {
    const float inverse = 1.0f / divisor;
#pragma omp simd
    for (long i = 0; i < count; ++i) values[i] *= inverse;
  } else {
#pragma omp simd
    for (long i = 0; i < count; ++i) values[i] /= divisor;
  }
}

class GlooGroup : public ProcessGroup {
 public:
  explicit GlooGroup(std::shared_ptr<const Shared> shared)
      : shared_(std::move(shared)),
        context_(shared_->context),
        // Closed before any waiter sees the failure: a waiter that returns
        // may free the buffers its operation was sending from, and gloo's
        // device thread sends on a peer's request (a receive it posted)
        // as long as the pair is open; from freed memory, that write fails
        // with EFAULT and gloo throws on its own thread, ending the process.
        // Weak: the queue's state lives on in Work handles, and must not
        // keep a destroyed group's connections open.
        queue_(std::make_unique<WorkQueue>(
            shared_->timeout,
            [weak = std::weak_ptr<const Shared>(shared_)](const absl::Status&) {
              if (auto shared = weak.lock()) {
                CloseConnections(*shared);
              }
            })),
        monitor_([this] { Monitor(); }) {}

  ~GlooGroup() override {
    {
      absl::MutexLock lock(&monitor_mu_);
      stopping_ = true;
    }
    monitor_.join();
    queue_.reset();
  }

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  absl::Duration timeout() const override { return shared_->timeout; }
  GroupMembers members() const override { return shared_->members; }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " floats"),
                 kNoPeer, [context = context_, data, op](uint32_t tag, Millis timeout) {
                   if (!data.empty()) gloo_ops::AllReduce(context, data, op, tag, timeout);
                   if (op == ReduceOp::kAvg) Scale(data, context->size);
                 });
  }

  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) override {
    if (absl::Status bad = CheckInt64Op(op); !bad.ok()) return WorkQueue::Finished(bad);
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " int64s"),
                 kNoPeer, [context = context_, data, op](uint32_t tag, Millis timeout) {
                   if (!data.empty()) gloo_ops::AllReduce(context, data, op, tag, timeout);
                 });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp op) override {
    if (absl::Status bad = CheckCounts("reduce_scatter", counts, input.size(), output.size());
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(
        absl::StrCat("reduce_scatter (", ReduceOpName(op), ") of ", input.size(), " floats"),
        kNoPeer,
        [context = context_, input, output, counts = std::move(counts), op](uint32_t tag,
                                                                            Millis timeout) {
          gloo_ops::ReduceScatter(context, input, output, counts, op, tag, timeout);
          if (op == ReduceOp::kAvg) Scale(output, context->size);
        });
  }

  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    return AllGatherOf(input, output, std::move(counts), "floats");
  }

  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input, absl::Span<uint16_t> output,
                                      std::vector<size_t> counts) override {
    return AllGatherOf(input, output, std::move(counts), "bf16s");
  }

  std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " floats from"), root,
                 [context = context_, data, root](uint32_t tag, Millis timeout) {
                   if (!data.empty()) gloo_ops::Broadcast(context, data, root, tag, timeout);
                 });
  }

  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " bytes from"), root,
                 [context = context_, data, root](uint32_t tag, Millis timeout) {
                   if (!data.empty()) gloo_ops::Broadcast(context, data, root, tag, timeout);
                 });
  }

  std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) override {
    if (absl::Status bad = CheckPointToPoint("send destination", destination, tag); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("send of ", data.size(), " floats with tag ", tag, " to"),
                 destination,
                 [context = context_, data, destination, tag](uint32_t, Millis timeout) {
                   gloo_ops::Send(context, data, destination, tag, timeout);
                 });
  }

  std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) override {
    if (absl::Status bad = CheckPointToPoint("recv source", source, tag); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("recv of ", data.size(), " floats with tag ", tag, " from"), source,
                 [context = context_, data, source, tag](uint32_t, Millis timeout) {
                   gloo_ops::Recv(context, data, source, tag, timeout);
                 });
  }

  std::shared_ptr<Work> Barrier() override {
    return Issue("barrier", kNoPeer, [context = context_](uint32_t tag, Millis timeout) {
      if (context->size > 1) gloo_ops::Barrier(context, tag, timeout);
    });
  }

  GroupHealth Health() const override { return queue_->health(); }

  void Abort(const absl::Status& cause) override {
    // Breaking the queue closes the connections (on_break): the thread
    // blocked in a gloo wait (if any) fails once its pair closes, and peers
    // blocked on us fail at once.
    queue_->Fail(cause);
  }

 private:
  // AllGather and AllGatherBf16: the same exchange of T's.
  template <typename T>
  std::shared_ptr<Work> AllGatherOf(absl::Span<const T> input, absl::Span<T> output,
                                    std::vector<size_t> counts, const char* unit) {
    if (absl::Status bad = CheckCounts("allgather", counts, output.size(), input.size());
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("allgather of ", output.size(), " ", unit), kNoPeer,
                 [context = context_, input, output, counts = std::move(counts)](uint32_t tag,
                                                                                 Millis timeout) {
                   if (!output.empty()) {
                     gloo_ops::AllGather(context, input, output, counts, tag, timeout);
                   }
                 });
  }

  static constexpr absl::Duration kMonitorInterval = absl::Milliseconds(50);

  // The gloo calls of one operation; may throw what gloo throws. `tag`
  // keeps concurrent collectives apart (it is the same on every rank, since
  // every rank issues the same sequence).
  using Body = std::function<void(uint32_t tag, Millis timeout)>;
  static constexpr int kNoPeer = -1;

  // `what` and `peer` (a group rank, or kNoPeer for a collective) as
  // GroupMembers::Describe takes them.
  std::shared_ptr<Work> Issue(const std::string& what, int peer, Body body) {
    absl::MutexLock lock(&issue_mu_);  // tag order == queue order
    uint32_t tag = next_tag_++;
    return queue_->Enqueue(
        shared_->members.Describe(what, peer, tag, rank(), size()),
        [shared = shared_, tag, body = std::move(body)](absl::Time deadline) {
          absl::Duration left = deadline - absl::Now();
          if (left <= absl::ZeroDuration()) {
            return absl::DeadlineExceededError("its deadline passed before it could start");
          }
          // A failure breaks the queue, which closes the connections.
          return RunGloo(*shared, [&] { body(tag, ToMillis(left)); });
        });
  }

  // This gloo's tcp transport wakes a pending receive when its connection
  // fails, but not a pending send (it waits out the timeout). So every
  // kMonitorInterval the pairs are probed: tryRecv on a slot no operation
  // uses throws the pair's error and otherwise does nothing. A failed pair
  // fails the group at once, naming the peer, and closes our connections
  // so the other peers fail too.
  void Monitor() {
    absl::MutexLock lock(&monitor_mu_);
    while (!monitor_mu_.AwaitWithTimeout(absl::Condition(&stopping_), kMonitorInterval)) {
      if (!queue_->first_error().ok()) continue;
      for (int peer = 0; peer < size(); ++peer) {
        try {
          gloo_ops::ProbeConnection(*context_, peer);
        } catch (const std::exception& error) {
          // A pair also breaks when one of our own waits timed out on it
          // ("Application timeout caused pair closure"): that stays
          // DEADLINE_EXCEEDED.
          // The group's name is in the message: when the group is idle
          // nothing else names it, and a watchdog passes this error on to
          // the rank's other groups as their cause.
          absl::Status status = StatusFromGlooError(error.what(), *shared_);
          const std::string connection =
              absl::StrCat("connection to ", shared_->members.Peer(peer));
          queue_->Fail(absl::Status(
              status.code(),
              status.code() == absl::StatusCode::kUnavailable
                  ? absl::StrCat(connection,
                                 " failed (that process died or closed the group): ", error.what())
                  : absl::StrCat(connection, ": ", status.message())));
          break;
        }
      }
    }
  }

  absl::Status CheckCounts(const char* op, const std::vector<size_t>& counts, size_t total,
                           size_t mine) const {
    return parallel::CheckCounts(op, counts, total, mine, rank(), size());
  }
  absl::Status CheckPeer(const char* what, int peer, bool self_ok) const {
    return parallel::CheckPeer(what, peer, self_ok, rank(), size());
  }
  absl::Status CheckPointToPoint(const char* what, int peer, int tag) const {
    return parallel::CheckPointToPoint(what, peer, tag, rank(), size());
  }

  const std::shared_ptr<const Shared> shared_;
  const std::shared_ptr<gloo::rendezvous::Context> context_;
  absl::Mutex issue_mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(issue_mu_) = 0;
  std::unique_ptr<WorkQueue> queue_;
  absl::Mutex monitor_mu_;
  bool stopping_ ABSL_GUARDED_BY(monitor_mu_) = false;
  std::thread monitor_;  // last: starts once everything above exists
};

// After the mesh is up: every rank's listening address, so an error that
// names an address can name the rank.
absl::StatusOr<std::vector<std::string>> ExchangeAddresses(rdzv::Store* store,
                                                           gloo::Context& context,
                                                           absl::Time deadline) {
  std::vector<std::string> addresses(context.size);
  if (context.size == 1) return addresses;
  const int rank = context.rank;
  addresses[rank] = WithoutSequence(context.getPair((rank + 1) % context.size)->address().str());
  absl::Status set = store->Set(absl::StrCat("address/", rank), addresses[rank]);
  if (!set.ok()) return set;
  for (int peer = 0; peer < context.size; ++peer) {
    if (peer == rank) continue;
    absl::StatusOr<std::string> address = store->Get(
        absl::StrCat("address/", peer), std::max(deadline - absl::Now(), absl::Milliseconds(1)));
    if (!address.ok()) return address.status();
    addresses[peer] = *std::move(address);
  }
  return addresses;
}

// gloo writes to its sockets with writev(2), which raises SIGPIPE when the
// peer has gone; with the default action that kills this process instead of
// failing the operation with UNAVAILABLE. Python ignores SIGPIPE at startup,
// which is why PyTorch's gloo never meets this. A handler someone installed
// on purpose is left alone.
void IgnoreSigpipeIfDefault() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateGlooGroup(rdzv::Store* store, int rank,
                                                              int size,
                                                              const GlooOptions& options) {
  if (store == nullptr) return absl::InvalidArgumentError("CreateGlooGroup: store is null");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("CreateGlooGroup: rank ", rank, " and size ",
                                                   size, "; expected 0 <= rank < size"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateGlooGroup: timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }
  if (absl::Status bad = CheckMembers("CreateGlooGroup", options.members, size); !bad.ok()) {
    return bad;
  }
  IgnoreSigpipeIfDefault();
  const absl::Time deadline = absl::Now() + options.timeout;
  const std::string where =
      absl::StrCat("connecting global rank ", options.members.Global(rank), " to group ",
                   options.members.name, " as its rank ", rank, " of ", size, ": ");

  std::shared_ptr<gloo::transport::Device> device;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.address;
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& error) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "cannot listen on address '", options.address, "': ", error.what()));
  }

  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(ToMillis(options.timeout));
  GlooStore gloo_store(store, options.timeout);
  try {
    context->connectFullMesh(gloo_store, device);
  } catch (const std::exception& error) {
    absl::Status store_error = gloo_store.first_error();
    if (!store_error.ok()) {
      return absl::Status(store_error.code(), absl::StrCat(where, store_error.message()));
    }
    Shared naming;  // no addresses yet, nor a context to name the other rank by
    naming.timeout = options.timeout;
    naming.members = options.members;
    absl::Status status = StatusFromGlooError(error.what(), naming);
    return absl::Status(status.code(), absl::StrCat(where, status.message()));
  }

  absl::StatusOr<std::vector<std::string>> addresses = ExchangeAddresses(store, *context, deadline);
  if (!addresses.ok()) {
    return absl::Status(addresses.status().code(),
                        absl::StrCat(where, addresses.status().message()));
  }
  auto shared = std::make_shared<Shared>();
  shared->context = std::move(context);
  shared->peer_addresses = *std::move(addresses);
  shared->timeout = options.timeout;
  shared->members = options.members;
  return std::unique_ptr<ProcessGroup>(new GlooGroup(std::move(shared)));
}

}  // namespace muster::parallel
