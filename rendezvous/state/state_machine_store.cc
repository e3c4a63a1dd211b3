// The per-round key-value store. Every call is fenced to the job's current
// RUNNING round (FenceRound) but not to a member: workers, which have no
// member id, use it to bootstrap their process groups.
//
// Store changes are durable (dirty) and wake waiters (changed jobs) but do
// not bump JobState.version: watchers do not see the store.
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

namespace {

// Keys one MultiGet or Wait names: each valid, at most max_keys_per_request.
template <typename Keys>
absl::Status ValidateKeys(const Keys& keys, const char* call, const Limits& limits) {
  if (static_cast<size_t>(keys.size()) > limits.max_keys_per_request) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s names %s (a key named twice counts twice); %s", call, Counted(keys.size(), "key"),
        DescribeLimit(limits.max_keys_per_request, "--max-keys-per-request")));
  }
  for (const std::string& key : keys) {
    if (auto status = ValidateKey(key, limits); !status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StateMachine::Set(const pb::SetRequest& request) {
  Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  if (auto status = ValidateKey(request.key(), s.limits); !status.ok()) {
    return status;
  }
  if (auto status = ValidateValue(request.value(), s.limits); !status.ok()) {
    return status;
  }
  if (auto status = s.PutKey(**job, request.key(), request.value()); !status.ok()) {
    return status;
  }
  s.MarkDurableChanged(**job);
  return absl::OkStatus();
}

absl::StatusOr<std::string> StateMachine::Get(const std::string& job_id, uint64_t round,
                                              const std::string& key) const {
  const Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(job_id, round);
  if (!job.ok()) return job.status();
  if (auto status = ValidateKey(key, s.limits); !status.ok()) return status;
  auto it = (*job)->store.find(key);
  if (it == (*job)->store.end()) {
    return absl::NotFoundError(
        absl::StrFormat("key \"%s\" is not set in round %d of job %s", key, round, job_id));
  }
  return it->second;
}

absl::StatusOr<pb::AddResponse> StateMachine::Add(const pb::AddRequest& request) {
  Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  if (auto status = ValidateKey(request.key(), s.limits); !status.ok()) {
    return status;
  }
  int64_t value = 0;
  auto it = (*job)->store.find(request.key());
  if (it != (*job)->store.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("key \"%s\" of job %s holds a value that is not a decimal integer; "
                        "Add needs one",
                        request.key(), request.job_id()));
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(value, request.delta(), &sum)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("adding %d to key \"%s\" (%d) would overflow int64", request.delta(),
                        request.key(), value));
  }
  if (auto status = s.PutKey(**job, request.key(), std::to_string(sum)); !status.ok()) {
    return status;
  }
  s.MarkDurableChanged(**job);
  pb::AddResponse response;
  response.set_value(sum);
  return response;
}

absl::StatusOr<pb::CompareAndSetResponse> StateMachine::CompareAndSet(
    const pb::CompareAndSetRequest& request) {
  Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  if (auto status = ValidateKey(request.key(), s.limits); !status.ok()) {
    return status;
  }
  if (auto status = ValidateValue(request.desired(), s.limits); !status.ok()) {
    return status;
  }
  auto& store = (*job)->store;
  auto it = store.find(request.key());
  const bool present = it != store.end();
  const bool swap =
      request.expect_absent() ? !present : present && it->second == request.expected();
  pb::CompareAndSetResponse response;
  if (swap) {
    if (auto status = s.PutKey(**job, request.key(), request.desired()); !status.ok()) {
      return status;
    }
    s.MarkDurableChanged(**job);
    response.set_swapped(true);
    response.set_present(true);
    response.set_value(request.desired());
  } else {
    response.set_present(present);
    if (present) response.set_value(it->second);
  }
  return response;
}

absl::StatusOr<pb::DeleteResponse> StateMachine::Delete(const pb::DeleteRequest& request) {
  Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  if (auto status = ValidateKey(request.key(), s.limits); !status.ok()) {
    return status;
  }
  pb::DeleteResponse response;
  response.set_deleted(s.EraseKey(**job, request.key()));
  if (response.deleted()) s.MarkDurableChanged(**job);
  return response;
}

absl::StatusOr<pb::MultiGetResponse> StateMachine::MultiGet(
    const pb::MultiGetRequest& request) const {
  const Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(request.job_id(), request.round());
  if (!job.ok()) return job.status();
  if (auto status = ValidateKeys(request.keys(), "MultiGet", s.limits); !status.ok()) {
    return status;
  }
  const auto& store = (*job)->store;
  // Sized before anything is copied: a key named 1000 times is 1000 copies.
  size_t response_bytes = 0;
  for (const std::string& key : request.keys()) {
    auto it = store.find(key);
    if (it != store.end()) response_bytes += it->second.size();
  }
  if (response_bytes > s.limits.max_response_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("MultiGet would return %s of values; %s", Counted(response_bytes, "byte"),
                        DescribeLimit(s.limits.max_response_bytes, "--max-response-bytes")));
  }
  pb::MultiGetResponse response;
  response.mutable_present()->Reserve(request.keys_size());
  response.mutable_values()->Reserve(request.keys_size());
  for (const std::string& key : request.keys()) {
    auto it = store.find(key);
    response.add_present(it != store.end());
    response.add_values(it != store.end() ? it->second : "");
  }
  return response;
}

absl::StatusOr<bool> StateMachine::AllSet(const std::string& job_id, uint64_t round,
                                          const std::vector<std::string>& keys) const {
  const Impl& s = *impl_;
  absl::StatusOr<Job*> job = s.FenceRound(job_id, round);
  if (!job.ok()) return job.status();
  if (auto status = ValidateKeys(keys, "Wait", s.limits); !status.ok()) {
    return status;
  }
  for (const std::string& key : keys) {
    if ((*job)->store.count(key) == 0) return false;
  }
  return true;
}

}  // namespace muster::rdzv
