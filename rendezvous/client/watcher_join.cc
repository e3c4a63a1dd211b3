// JoinAndWaitForRound (declared in watcher.h).
#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "rendezvous/client/watcher.h"

namespace muster::rdzv {
namespace {

const pb::Member* FindMember(const pb::JobState& state, const std::string& member_id) {
  for (const pb::Member& member : state.members()) {
    if (member.member_id() == member_id) return &member;
  }
  return nullptr;
}

CallOptions WithinDeadline(const Client& client, absl::Time deadline) {
  CallOptions call;
  call.timeout = std::max(absl::Milliseconds(1),
                          std::min(client.options().rpc_timeout, deadline - absl::Now()));
  return call;
}

}  // namespace

absl::StatusOr<RoundAssignment> JoinAndWaitForRound(Client& client, const pb::JoinRequest& request,
                                                    JobWatcher* watcher, absl::Time deadline) {
  absl::StatusOr<pb::JoinResponse> joined = client.Join(request, WithinDeadline(client, deadline));
  if (!joined.ok()) return joined.status();

  RoundAssignment result;
  result.member_id = joined->member_id();
  result.lease_ttl_ms = joined->lease_ttl_ms();
  uint64_t round = joined->round();

  std::unique_ptr<JobWatcher> own_watcher;
  if (watcher == nullptr) {
    own_watcher = std::make_unique<JobWatcher>(&client, request.job_id());
    watcher = own_watcher.get();
  }

  const std::string& member_id = result.member_id;
  auto renew_every = [&] {
    return std::max(absl::Milliseconds(result.lease_ttl_ms) / 3, absl::Milliseconds(10));
  };
  absl::Time next_renewal = absl::Now() + renew_every();
  for (;;) {
    absl::StatusOr<pb::JobState> state = watcher->WaitFor(
        [&](const pb::JobState& s) {
          return IsTerminalPhase(s.phase()) || s.round() > round ||
                 (s.phase() == pb::RUNNING && s.round() == round &&
                  FindMember(s, member_id) != nullptr);
        },
        std::min(deadline, next_renewal));
    if (state.ok()) {
      if (const pb::Member* self = FindMember(*state, member_id);
          self != nullptr && state->phase() == pb::RUNNING) {
        result.state = *std::move(state);
        result.self = *FindMember(result.state, member_id);
        return result;
      }
      if (IsTerminalPhase(state->phase())) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", request.job_id(), " is ", pb::Phase_Name(state->phase()),
                         state->status_message().empty() ? "" : ": ", state->status_message()));
      }
      // A newer round formed or is forming without us: join it, keeping
      // our member id (and so our place in the order).
      pb::JoinRequest again = request;
      again.set_member_id(member_id);
      joined = client.Join(again, WithinDeadline(client, deadline));
      if (!joined.ok()) return joined.status();
      result.lease_ttl_ms = joined->lease_ttl_ms();
      round = std::max<uint64_t>(joined->round(), state->round());
      next_renewal = absl::Now() + renew_every();
      continue;
    }
    if (state.status().code() != absl::StatusCode::kDeadlineExceeded || absl::Now() >= deadline) {
      return state.status();
    }
    pb::KeepAliveRequest keep_alive;
    keep_alive.set_job_id(request.job_id());
    keep_alive.set_member_id(member_id);
    absl::StatusOr<pb::KeepAliveResponse> renewed =
        client.KeepAlive(keep_alive, WithinDeadline(client, deadline));
    if (!renewed.ok() && renewed.status().code() != absl::StatusCode::kUnavailable &&
        renewed.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return renewed.status();
    }
    next_renewal = absl::Now() + renew_every();
  }
}

}  // namespace muster::rdzv
