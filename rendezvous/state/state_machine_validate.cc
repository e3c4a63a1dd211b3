// Request validation, round fencing, job secrets.
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rendezvous/state/state_machine_impl.h"

namespace muster::rdzv {

namespace {

// Ids end up in logs, metrics labels and store key prefixes ("job/round/"),
// so they are printable ASCII without whitespace or '/'.
bool IsIdChar(char c) { return c > ' ' && c <= '~' && c != '/'; }

}  // namespace

absl::Status ValidateId(const char* field, const std::string& id, const Limits& limits) {
  if (id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  if (id.size() > limits.max_id_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", id.size(), " bytes; the limit is ", limits.max_id_bytes));
  }
  for (char c : id) {
    if (!IsIdChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s \"%s\" has character 0x%02x; ids are printable ASCII without "
                          "whitespace or '/'",
                          field, absl::CHexEscape(id), static_cast<unsigned char>(c)));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateJobConfig(const pb::JobConfig& config) {
  if (config.min_nodes() < 1) {
    return absl::InvalidArgumentError("config.min_nodes must be >= 1");
  }
  if (config.max_nodes() < config.min_nodes()) {
    return absl::InvalidArgumentError(absl::StrCat("config.max_nodes (", config.max_nodes(),
                                                   ") must be >= config.min_nodes (",
                                                   config.min_nodes(), ")"));
  }
  if (config.lease_ttl_ms() < kMinLeaseTtlMs) {
    return absl::InvalidArgumentError(absl::StrCat("config.lease_ttl_ms is ", config.lease_ttl_ms(),
                                                   "; it must be >= ", kMinLeaseTtlMs));
  }
  if (config.join_timeout_ms() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.join_timeout_ms is ", config.join_timeout_ms(), "; it must be > 0"));
  }
  if (config.last_call_timeout_ms() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.last_call_timeout_ms is ", config.last_call_timeout_ms(), "; it must be >= 0"));
  }
  if (config.max_restarts() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.max_restarts is ", config.max_restarts(), "; it must be >= 0"));
  }
  return absl::OkStatus();
}

std::string DescribeLimit(size_t limit, const char* flag) {
  return absl::StrCat("the limit is ", limit, " (rendezvous ", flag, ")");
}

std::string Counted(size_t count, const char* noun) {
  return absl::StrCat(count, " ", noun, count == 1 ? "" : "s");
}

absl::Status CheckJoinTimeout(const pb::JobConfig& config, const Limits& limits) {
  if (config.join_timeout_ms() > limits.max_join_timeout_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.join_timeout_ms is ", config.join_timeout_ms(),
        "; it must be <= ", limits.max_join_timeout_ms, " (rendezvous --max-join-timeout-ms)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLimits(const Limits& limits) {
  auto positive = [](size_t value, const char* flag) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(absl::StrCat(flag, " must be > 0"));
  };
  for (auto [value, flag] : {std::pair{limits.max_id_bytes, "max_id_bytes"},
                             std::pair{limits.max_key_bytes, "--max-key-bytes"},
                             std::pair{limits.max_value_bytes, "--max-value-bytes"},
                             std::pair{limits.max_keys_per_request, "--max-keys-per-request"},
                             std::pair{limits.max_jobs, "--max-jobs"}}) {
    if (absl::Status status = positive(value, flag); !status.ok()) {
      return status;
    }
  }
  if (limits.max_join_timeout_ms <= 0) {
    return absl::InvalidArgumentError("--max-join-timeout-ms must be > 0");
  }
  if (limits.max_response_bytes < limits.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-response-bytes (", limits.max_response_bytes, ") must be >= --max-value-bytes (",
        limits.max_value_bytes, ") so that every value can be read"));
  }
  if (limits.max_job_bytes < limits.max_key_bytes + limits.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-job-bytes (", limits.max_job_bytes,
                     ") must be >= --max-key-bytes + --max-value-bytes (",
                     limits.max_key_bytes + limits.max_value_bytes, ")"));
  }
  // Everything the state can hold must serialize (protobuf stops at 2 GiB).
  const size_t unrefused = MaxUnrefusedJobBytes(limits);
  if (limits.max_total_bytes >= kMaxStateBytes ||
      limits.max_jobs > (kMaxStateBytes - limits.max_total_bytes) / unrefused) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-total-bytes (", limits.max_total_bytes, ") plus --max-jobs (", limits.max_jobs,
        ") times the ", unrefused,
        " bytes of failures and status a job may record must stay within ", kMaxStateBytes,
        " bytes, or the state file could not be written; "
        "lower --max-total-bytes or --max-jobs"));
  }
  return absl::OkStatus();
}

absl::Status CheckSameConfig(const std::string& job_id, const pb::JobConfig& job_config,
                             const pb::JobConfig& requested) {
  auto conflict = [&](const char* name, int64_t have, int64_t asked) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "job \"%s\": %s is %d but this join asks for %d", job_id, name, have, asked));
  };
  if (job_config.min_nodes() != requested.min_nodes())
    return conflict("min_nodes", job_config.min_nodes(), requested.min_nodes());
  if (job_config.max_nodes() != requested.max_nodes())
    return conflict("max_nodes", job_config.max_nodes(), requested.max_nodes());
  if (job_config.join_timeout_ms() != requested.join_timeout_ms())
    return conflict("join_timeout_ms", job_config.join_timeout_ms(), requested.join_timeout_ms());
  if (job_config.last_call_timeout_ms() != requested.last_call_timeout_ms())
    return conflict("last_call_timeout_ms", job_config.last_call_timeout_ms(),
                    requested.last_call_timeout_ms());
  if (job_config.lease_ttl_ms() != requested.lease_ttl_ms())
    return conflict("lease_ttl_ms", job_config.lease_ttl_ms(), requested.lease_ttl_ms());
  if (job_config.max_restarts() != requested.max_restarts())
    return conflict("max_restarts", job_config.max_restarts(), requested.max_restarts());
  // 0 and 1 both mean any world.
  const uint32_t have = std::max(job_config.world_size_multiple(), 1u);
  const uint32_t asked = std::max(requested.world_size_multiple(), 1u);
  if (have != asked) return conflict("world_size_multiple", have, asked);
  return absl::OkStatus();
}

absl::Status ValidateKey(const std::string& key, const Limits& limits) {
  if (key.empty()) return absl::InvalidArgumentError("key is empty");
  // Over a Limits cap is RESOURCE_EXHAUSTED (docs/rendezvous.md), malformed is
  // INVALID_ARGUMENT.
  if (key.size() > limits.max_key_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "key is ", key.size(), " bytes; ", DescribeLimit(limits.max_key_bytes, "--max-key-bytes")));
  }
  return absl::OkStatus();
}

absl::Status ValidateValue(const std::string& value, const Limits& limits) {
  if (value.size() > limits.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("value is ", value.size(), " bytes; ",
                     DescribeLimit(limits.max_value_bytes, "--max-value-bytes")));
  }
  return absl::OkStatus();
}

absl::Status JobClosedError(const Job& job) {
  std::string how;
  switch (job.phase) {
    case pb::SUCCEEDED:
      how = absl::StrCat("succeeded at round ", job.round);
      break;
    case pb::FAILED:
      how = absl::StrCat("failed at round ", job.round, ": ", job.status_message);
      break;
    default:
      how = absl::StrCat("closed at round ", job.round, ": ", job.status_message);
      break;
  }
  return absl::FailedPreconditionError(absl::StrFormat("job \"%s\" is closed (%s)", job.id, how));
}

absl::StatusOr<Job*> StateMachine::Impl::FenceRound(const std::string& job_id,
                                                    uint64_t round) const {
  if (auto status = ValidateId("job_id", job_id, limits); !status.ok()) {
    return status;
  }
  Job* job = FindJob(job_id);
  if (job == nullptr) {
    return absl::NotFoundError(absl::StrFormat("job \"%s\" not found", job_id));
  }
  // A stale caller learns it is stale first, even if the job has finished:
  // ABORTED tells it to stop acting on that round.
  if (round < job->round) {
    return absl::AbortedError(absl::StrFormat("round %d of job %s is over; the current round is %d",
                                              round, job_id, job->round));
  }
  if (job->finished()) return JobClosedError(*job);
  if (round > job->round) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "round %d of job %s has not started; the current round is %d", round, job_id, job->round));
  }
  if (job->phase != pb::RUNNING) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "round %d of job %s is still gathering members; wait until it runs", round, job_id));
  }
  return job;
}

absl::StatusOr<MemberRecord*> StateMachine::Impl::RoundMember(Job& job,
                                                              const std::string& member_id) const {
  if (auto status = ValidateId("member_id", member_id, limits); !status.ok()) {
    return status;
  }
  auto it = job.members.find(member_id);
  if (it == job.members.end() || it->second.group_rank < 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("member %s is not in round %d of job %s", member_id, job.round, job.id));
  }
  return &it->second;
}

std::string Sha256(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

bool DigestsEqual(const std::string& a, const std::string& b) {
  // Digests have a fixed length, so comparing the sizes leaks nothing.
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string Truncate(const std::string& text, size_t max_bytes) {
  return text.size() <= max_bytes ? text : text.substr(0, max_bytes);
}

std::string MakeMemberId(const std::string& hostname, uint64_t number, const Limits& limits) {
  std::string suffix = absl::StrCat("-", number);
  std::string base = hostname.empty() ? "node" : hostname;
  for (char& c : base) {
    if (!IsIdChar(c)) c = '_';
  }
  size_t room = limits.max_id_bytes > suffix.size() ? limits.max_id_bytes - suffix.size() : 0;
  if (base.size() > room) base.resize(room);
  return base + suffix;
}

}  // namespace muster::rdzv
