// Byte accounting: what each job holds in the state file, capped per job
// (max_job_bytes) and in total (max_total_bytes) so that the snapshot always
// serializes (protobuf refuses 2 GiB) and one tenant cannot take the
// server's memory.
//
// The charges are upper bounds on the serialized size: every string is
// counted with room for its tag and length, and every member id once for
// each list it can appear in. The state machine tests check
// Snapshot().ByteSizeLong() <= total_bytes().
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

namespace {

// A tag and a length prefix (a varint of up to 5 bytes), rounded up.
constexpr size_t kFieldOverhead = 8;
// A StoreEntry around its key and value.
constexpr size_t kStoreEntryOverhead = 3 * kFieldOverhead;
// A MemberRecord's numbers (int32s take 10 bytes when negative) and the
// framing of its strings.
constexpr size_t kMemberOverhead = 128;
// A JobRecord's config, digest, counters and framing.
constexpr size_t kJobOverhead = 256;
// Failure records beside their strings.
constexpr size_t kFailureOverhead = 64;

absl::Status Exhausted(const std::string& what, const char* flag, size_t holds, size_t more,
                       size_t limit) {
  return absl::ResourceExhaustedError(
      absl::StrFormat("%s holds %s and this call would add %s; %s", what, Counted(holds, "byte"),
                      Counted(more, "byte"), DescribeLimit(limit, flag)));
}

}  // namespace

size_t MaxUnrefusedJobBytes(const Limits& limits) {
  const size_t failure = kMaxMessageBytes + limits.max_id_bytes + kFailureOverhead;
  // The status message quotes the last failure ("restart budget ...").
  const size_t status = failure + kFailureOverhead;
  return kMaxFailuresKept * failure + status;
}

size_t StoreEntryBytes(const std::string& key, const std::string& value) {
  return key.size() + value.size() + kStoreEntryOverhead;
}

size_t MemberBytes(const MemberRecord& member) {
  // The id also appears in round_members, a queue and
  // previous_round_members.
  return 4 * (member.id.size() + kFieldOverhead) + member.address.size() + member.hostname.size() +
         kMemberOverhead;
}

size_t RecordBytes(const Job& job) {
  size_t bytes = kJobOverhead + job.id.size() + job.status_message.size();
  for (const pb::Failure& failure : job.failures) {
    bytes += failure.ByteSizeLong() + kFieldOverhead;
  }
  return bytes;
}

size_t CountStoreBytes(const Job& job) {
  size_t bytes = 0;
  for (const auto& [key, value] : job.store) {
    bytes += StoreEntryBytes(key, value);
  }
  return bytes;
}

size_t CountMemberBytes(const Job& job) {
  size_t bytes = 0;
  for (const auto& [id, member] : job.members) bytes += MemberBytes(member);
  return bytes;
}

void CountJobBytes(Job& job) {
  job.store_bytes = CountStoreBytes(job);
  job.member_bytes = CountMemberBytes(job);
  job.record_bytes = RecordBytes(job);
}

absl::Status StateMachine::Impl::CheckGrowth(const Job* job, size_t more) const {
  if (job != nullptr && job->bytes() + more > limits.max_job_bytes) {
    return Exhausted(absl::StrCat("job ", job->id), "--max-job-bytes", job->bytes(), more,
                     limits.max_job_bytes);
  }
  if (total_bytes + more > limits.max_total_bytes) {
    return Exhausted("the server", "--max-total-bytes", total_bytes, more, limits.max_total_bytes);
  }
  return absl::OkStatus();
}

absl::Status StateMachine::Impl::PutKey(Job& job, const std::string& key, std::string value) {
  auto it = job.store.find(key);
  const size_t new_bytes = StoreEntryBytes(key, value);
  const size_t old_bytes = it == job.store.end() ? 0 : StoreEntryBytes(key, it->second);
  if (it == job.store.end() && job.store.size() >= limits.max_keys_per_job) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "round %d of job %s holds %s; %s", job.round, job.id, Counted(job.store.size(), "key"),
        DescribeLimit(limits.max_keys_per_job, "--max-keys-per-job")));
  }
  if (new_bytes > old_bytes) {
    if (absl::Status room = CheckGrowth(&job, new_bytes - old_bytes); !room.ok()) {
      return room;
    }
  }
  if (it == job.store.end()) {
    job.store.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  job.store_bytes = job.store_bytes - old_bytes + new_bytes;
  total_bytes = total_bytes - old_bytes + new_bytes;
  return absl::OkStatus();
}

bool StateMachine::Impl::EraseKey(Job& job, const std::string& key) {
  auto it = job.store.find(key);
  if (it == job.store.end()) return false;
  const size_t bytes = StoreEntryBytes(key, it->second);
  job.store.erase(it);
  job.store_bytes -= bytes;
  total_bytes -= bytes;
  return true;
}

void StateMachine::Impl::ClearStore(Job& job) {
  job.store.clear();
  total_bytes -= job.store_bytes;
  job.store_bytes = 0;
}

void StateMachine::Impl::RechargeMember(Job& job, const MemberRecord& member, size_t old_bytes) {
  const size_t new_bytes = MemberBytes(member);
  job.member_bytes = job.member_bytes - old_bytes + new_bytes;
  total_bytes = total_bytes - old_bytes + new_bytes;
}

void StateMachine::Impl::RechargeRecord(Job& job) {
  const size_t new_bytes = RecordBytes(job);
  total_bytes = total_bytes - job.record_bytes + new_bytes;
  job.record_bytes = new_bytes;
}

void StateMachine::Impl::ChargeJob(Job& job) {
  CountJobBytes(job);
  total_bytes += job.bytes();
}

void StateMachine::Impl::UnchargeJob(const Job& job) { total_bytes -= job.bytes(); }

absl::StatusOr<size_t> StateMachine::JobBytes(const std::string& job_id) const {
  const Job* job = impl_->FindJob(job_id);
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
  }
  return job->bytes();
}

size_t StateMachine::total_bytes() const { return impl_->total_bytes; }

}  // namespace muster::rdzv
