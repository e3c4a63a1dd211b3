#include "rendezvous/server/group_commit.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {
constexpr absl::Duration kRetryBackoff = absl::Milliseconds(200);
}  // namespace

GroupCommitter::GroupCommitter(const StateFile* file, SnapshotFn snapshot, RollbackFn rollback)
    : file_(file), snapshot_(std::move(snapshot)), rollback_(std::move(rollback)) {}

absl::Status GroupCommitter::Undone() {
  return absl::UnavailableError(
      "change not durable: the state file could not be written, and the change was undone");
}

GroupCommitter::~GroupCommitter() { Stop().IgnoreError(); }

void GroupCommitter::Start() {
  // What the service starts from is what the disk holds (or nothing).
  if (rollback_) last_durable_ = snapshot_().first;
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
  }
  writer_ = std::thread([this] { WriterLoop(); });
}

void GroupCommitter::RunWhenDurable(uint64_t seq, DurableCallback done) {
  absl::Status inline_status;
  {
    absl::MutexLock lock(&mu_);
    if (seq > durable_seq_ && !stopping_) {
      waiting_.emplace(seq, std::move(done));
      if (seq > requested_seq_) requested_seq_ = seq;
      return;
    }
    if (seq > durable_seq_) {
      inline_status =
          absl::UnavailableError("server is shutting down; the change may not be durable");
    }
    for (const auto& [from, to] : undone_) {
      if (seq > from && seq < to) inline_status = Undone();
    }
  }
  done(inline_status);
}

void GroupCommitter::WriterLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto work_or_stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return requested_seq_ > durable_seq_ || stopping_;
      };
      mu_.Await(absl::Condition(&work_or_stop));
      // Stop's final write covers whatever is still pending.
      if (stopping_) return;
    }
    if (!WriteOnce()) {
      // Back off so a full or read-only disk does not become a busy loop;
      // the next attempt still covers every pending mutation.
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), kRetryBackoff);
    }
  }
}

bool GroupCommitter::WriteOnce() {
  // The snapshot is taken outside mu_: the snapshot function takes the
  // service mutex, and the service calls RunWhenDurable after releasing it,
  // so holding both here could only invert the lock order.
  std::pair<state::ServerState, uint64_t> snapshot = snapshot_();
  absl::Status status = file_->Write(snapshot.first);
  if (!status.ok()) {
    spdlog::error("rendezvous: could not persist state: {}", status.ToString());
    status = absl::UnavailableError(absl::StrCat("change not durable: ", status.message()));
  }
  if (!status.ok() && rollback_) {
    // Back to what the disk holds: every mutation since fails, including
    // those after the snapshot, which were made on top of the undone ones.
    const uint64_t restored = rollback_(last_durable_);
    std::vector<DurableCallback> undone, restored_ready;
    {
      absl::MutexLock lock(&mu_);
      undone_.emplace_back(durable_seq_, restored);
      durable_seq_ = restored;
      auto end = waiting_.upper_bound(restored);
      for (auto it = waiting_.begin(); it != end; ++it) {
        (it->first < restored ? undone : restored_ready).push_back(std::move(it->second));
      }
      waiting_.erase(waiting_.begin(), end);
      if (requested_seq_ <= restored) requested_seq_ = durable_seq_;
    }
    for (DurableCallback& done : undone) done(status);
    for (DurableCallback& done : restored_ready) done(absl::OkStatus());
    return false;
  }
  if (status.ok() && rollback_) last_durable_ = std::move(snapshot.first);
  std::vector<DurableCallback> ready;
  {
    absl::MutexLock lock(&mu_);
    uint64_t covered = snapshot.second;
    if (status.ok() && covered > durable_seq_) durable_seq_ = covered;
    // On failure the callers covered by this attempt are told so rather
    // than left hanging; a later mutation is retried with the next write.
    auto end = waiting_.upper_bound(covered);
    for (auto it = waiting_.begin(); it != end; ++it) {
      ready.push_back(std::move(it->second));
    }
    waiting_.erase(waiting_.begin(), end);
    if (!status.ok() && requested_seq_ <= covered && waiting_.empty()) {
      // Nothing is waiting any more: do not retry until a new mutation.
      requested_seq_ = durable_seq_;
    }
  }
  for (DurableCallback& done : ready) done(status);
  return status.ok();
}

absl::Status GroupCommitter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return last_stop_status_;
    stopping_ = true;
    if (!started_) {
      // Never started (the server failed to come up, perhaps over an
      // unreadable state file): writing now would replace that file.
      stopped_ = true;
      return last_stop_status_;
    }
  }
  if (writer_.joinable()) writer_.join();
  // A final snapshot, so state changed without a durable reply (deadlines
  // applied by the timer, lease renewals) is saved as of now.
  absl::Status status = file_->Write(snapshot_().first);
  std::multimap<uint64_t, DurableCallback> leftover;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    last_stop_status_ = status;
    leftover.swap(waiting_);
  }
  for (auto& entry : leftover) entry.second(status);
  return status;
}

}  // namespace muster::rdzv
