// RemoteStore (declared in store.h): the Store interface over the Client.
#include <utility>

#include "rendezvous/client/rpc.h"
#include "rendezvous/client/store.h"

namespace muster::rdzv {
namespace {

// Wait times go over the wire in whole milliseconds; round a positive
// sub-millisecond timeout up so it still means "block".
int64_t WaitMs(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return 0;
  return std::max<int64_t>(1,
                           absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1))));
}

}  // namespace

RemoteStore::RemoteStore(Client* client, std::string job_id, uint64_t round)
    : client_(client), job_id_(std::move(job_id)), round_(round) {}

absl::Status RemoteStore::Set(absl::string_view key, absl::string_view value) {
  pb::SetRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  return client_->Set(request).status();
}

absl::StatusOr<std::string> RemoteStore::Get(absl::string_view key, absl::Duration timeout) {
  pb::GetRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  request.set_key(std::string(key));
  request.set_wait_ms(WaitMs(timeout));
  absl::StatusOr<pb::GetResponse> response = client_->Get(request);
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_value());
}

absl::StatusOr<int64_t> RemoteStore::Add(absl::string_view key, int64_t delta) {
  pb::AddRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  request.set_key(std::string(key));
  request.set_delta(delta);
  absl::StatusOr<pb::AddResponse> response = client_->Add(request);
  if (!response.ok()) return response.status();
  return response->value();
}

absl::StatusOr<Store::CasResult> RemoteStore::CompareAndSet(
    absl::string_view key, const std::optional<std::string>& expected, absl::string_view desired) {
  pb::CompareAndSetRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  request.set_key(std::string(key));
  request.set_expect_absent(!expected.has_value());
  if (expected.has_value()) request.set_expected(*expected);
  request.set_desired(std::string(desired));
  absl::StatusOr<pb::CompareAndSetResponse> response = client_->CompareAndSet(request);
  if (!response.ok()) return response.status();
  CasResult result;
  result.swapped = response->swapped();
  result.present = response->present();
  result.value = std::move(*response->mutable_value());
  return result;
}

absl::StatusOr<bool> RemoteStore::Delete(absl::string_view key) {
  pb::DeleteRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  request.set_key(std::string(key));
  absl::StatusOr<pb::DeleteResponse> response = client_->Delete(request);
  if (!response.ok()) return response.status();
  return response->deleted();
}

absl::Status RemoteStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  pb::WaitRequest request;
  request.set_job_id(job_id_);
  request.set_round(round_);
  for (const std::string& key : keys) request.add_keys(key);
  request.set_wait_ms(WaitMs(timeout));
  return client_->Wait(request).status();
}

}  // namespace muster::rdzv
