#include "rendezvous/client/store.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::rdzv {

// ---------------------------------------------------------------- InMemoryStore

absl::Status InMemoryStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::string(value);
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto it = values_.find(key);
    if (it != values_.end()) return it->second;
    if (timeout <= absl::ZeroDuration()) {
      return absl::NotFoundError(absl::StrCat("key \"", key, "\" is absent"));
    }
    if (changed_.WaitWithDeadline(&mu_, deadline) && !values_.contains(key)) {
      return absl::DeadlineExceededError(
          absl::StrCat("key \"", key, "\" still absent after ", absl::FormatDuration(timeout)));
    }
  }
}

absl::StatusOr<int64_t> InMemoryStore::Add(absl::string_view key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  int64_t value = 0;
  auto it = values_.find(key);
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("value of key \"", key, "\" is \"", it->second,
                                                   "\"; Add expects a decimal integer"));
  }
  value += delta;
  values_[key] = absl::StrCat(value);
  changed_.SignalAll();
  return value;
}

absl::StatusOr<Store::CasResult> InMemoryStore::CompareAndSet(
    absl::string_view key, const std::optional<std::string>& expected, absl::string_view desired) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  const bool matches =
      expected.has_value() ? (it != values_.end() && it->second == *expected) : it == values_.end();
  CasResult result;
  if (matches) {
    values_[key] = std::string(desired);
    changed_.SignalAll();
    result.swapped = true;
    result.present = true;
    result.value = std::string(desired);
  } else if (it != values_.end()) {
    result.present = true;
    result.value = it->second;
  }
  return result;
}

absl::StatusOr<bool> InMemoryStore::Delete(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  return values_.erase(key) > 0;
}

absl::Status InMemoryStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  for (;;) {
    const std::string* missing = nullptr;
    for (const std::string& key : keys) {
      if (!values_.contains(key)) {
        missing = &key;
        break;
      }
    }
    if (missing == nullptr) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("key \"", *missing, "\" still absent after ",
                                                      absl::FormatDuration(timeout)));
    }
    changed_.WaitWithDeadline(&mu_, deadline);
  }
}

// ---------------------------------------------------------------- PrefixStore

PrefixStore::PrefixStore(Store* base, std::string prefix)
    : base_(base), prefix_(std::move(prefix)) {}

std::string PrefixStore::Scoped(absl::string_view key) const {
  return absl::StrCat(prefix_, "/", key);
}

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) {
  return base_->Set(Scoped(key), value);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key, absl::Duration timeout) {
  return base_->Get(Scoped(key), timeout);
}

absl::StatusOr<int64_t> PrefixStore::Add(absl::string_view key, int64_t delta) {
  return base_->Add(Scoped(key), delta);
}

absl::StatusOr<Store::CasResult> PrefixStore::CompareAndSet(
    absl::string_view key, const std::optional<std::string>& expected, absl::string_view desired) {
  return base_->CompareAndSet(Scoped(key), expected, desired);
}

absl::StatusOr<bool> PrefixStore::Delete(absl::string_view key) {
  return base_->Delete(Scoped(key));
}

absl::Status PrefixStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  std::vector<std::string> scoped;
  scoped.reserve(keys.size());
  for (const std::string& key : keys) scoped.push_back(Scoped(key));
  return base_->Wait(scoped, timeout);
}

}  // namespace muster::rdzv
