#include "parallel/gloo/store.h"

#include <gloo/common/error.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muster::parallel {

GlooStore::GlooStore(rdzv::Store* store, absl::Duration timeout)
    : store_(store), timeout_(timeout) {}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status status = store_->Set(key, absl::string_view(data.data(), data.size()));
  if (!status.ok()) Throw(status, absl::StrCat("set '", key, "'"));
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = store_->Get(key, timeout_);
  if (!value.ok()) Throw(value.status(), absl::StrCat("get '", key, "'"));
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds::zero());
}

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  // gloo passes kNoTimeout (zero) for "no limit"; never block forever.
  absl::Duration limit =
      timeout > std::chrono::milliseconds::zero() ? absl::FromChrono(timeout) : timeout_;
  absl::Status status = store_->Wait(keys, limit);
  if (!status.ok()) {
    Throw(status, absl::StrCat("wait for '", absl::StrJoin(keys, "', '"), "'"));
  }
}

absl::Status GlooStore::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

void GlooStore::Throw(const absl::Status& status, const std::string& what) {
  {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) {
      first_error_ =
          absl::Status(status.code(), absl::StrCat("store ", what, ": ", status.message()));
    }
  }
  throw gloo::IoException(absl::StrCat("store ", what, " failed: ", status.ToString()));
}

}  // namespace muster::parallel
