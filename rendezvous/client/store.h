// The key-value store that workers and agents rendezvous through: one
// interface, three implementations.
//   InMemoryStore  a thread-safe map; for tests and single-process runs
//   RemoteStore    the rendezvous server's store of one (job, round)
//   PrefixStore    any Store, with every key prefixed (scoping)
// Gloo's rendezvous::Store and the NCCL id exchange are adapters over it.
//
// Thread-safety: every implementation is thread-safe.
//
// Errors common to all: DEADLINE_EXCEEDED when a blocking call's timeout
// passes; NOT_FOUND from Get with a zero timeout when the key is absent;
// INVALID_ARGUMENT from Add when the stored value is not a decimal integer.
// RemoteStore adds the server's codes (ABORTED: the round is over,
// FAILED_PRECONDITION: it has not started, RESOURCE_EXHAUSTED, ...).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muster::rdzv {

class Client;

class Store {
 public:
  struct CasResult {
    bool swapped = false;
    bool present = false;  // whether the key exists after the call
    std::string value;     // its value after the call (if present)
  };

  virtual ~Store() = default;

  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // Blocks until `key` exists and returns its value. A zero timeout does
  // not block: NOT_FOUND if absent.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;

  // Adds `delta` to the decimal integer stored at `key` (absent: 0) and
  // returns the new value.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;

  // Stores `desired` if the key's value equals `expected`, or, when
  // `expected` is nullopt, if the key is absent.
  virtual absl::StatusOr<CasResult> CompareAndSet(absl::string_view key,
                                                  const std::optional<std::string>& expected,
                                                  absl::string_view desired) = 0;

  // Returns whether the key existed.
  virtual absl::StatusOr<bool> Delete(absl::string_view key) = 0;

  // Blocks until every key exists.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

class InMemoryStore : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<CasResult> CompareAndSet(absl::string_view key,
                                          const std::optional<std::string>& expected,
                                          absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::CondVar changed_;  // signalled on every write
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// Keys become prefix + "/" + key in `base`, which is not owned and must
// outlive this store.
class PrefixStore : public Store {
 public:
  PrefixStore(Store* base, std::string prefix);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<CasResult> CompareAndSet(absl::string_view key,
                                          const std::optional<std::string>& expected,
                                          absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

 private:
  std::string Scoped(absl::string_view key) const;

  Store* const base_;
  const std::string prefix_;
};

// The store of one (job, round) on the rendezvous server. The server scopes
// keys to the round: they vanish when it ends, and calls made after that get
// ABORTED. The Client is not owned and must outlive this store; its job
// secret must be the job's.
class RemoteStore : public Store {
 public:
  RemoteStore(Client* client, std::string job_id, uint64_t round);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<CasResult> CompareAndSet(absl::string_view key,
                                          const std::optional<std::string>& expected,
                                          absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;

  uint64_t round() const { return round_; }

 private:
  Client* const client_;
  const std::string job_id_;
  const uint64_t round_;
};

}  // namespace muster::rdzv
