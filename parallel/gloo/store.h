// gloo::rendezvous::Store over muster's rdzv::Store (one store interface
// for every user), so gloo's connectFullMesh can exchange addresses
// through the in-memory store in tests or the rendezvous server's round
// store in real jobs.
//
// Gloo expects exceptions from its store; every failed Status becomes a
// gloo::IoException whose message carries the status code and the key. The
// first such Status is also kept (first_error()) so the caller can report
// the original code (DEADLINE_EXCEEDED, ABORTED, ...) instead of a string.
//
// Ownership: `store` is not owned and must outlive this adapter.
// Thread-safety: as thread-safe as `store` (all muster stores are).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/client/store.h"

namespace muster::parallel {

class GlooStore : public gloo::rendezvous::Store {
 public:
  // `timeout` bounds get() and wait() when gloo gives no timeout of its own.
  GlooStore(rdzv::Store* store, absl::Duration timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Blocks until the key exists, like gloo's own stores.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // OK, or the Status behind the first exception thrown.
  absl::Status first_error() const;

 private:
  // Records `status` (if first) and throws it as a gloo::IoException.
  [[noreturn]] void Throw(const absl::Status& status, const std::string& what);

  rdzv::Store* const store_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::parallel
