// Client helpers that need no channel: endpoint parsing, file reading,
// backoff and Cancellation (declared in rpc.h).
#include <algorithm>
#include <fstream>
#include <sstream>

#include <grpcpp/grpcpp.h>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rendezvous/client/rpc.h"

namespace muster::rdzv {
namespace {

absl::Status BadEndpoint(const std::string& endpoint, const char* why) {
  return absl::InvalidArgumentError(
      absl::StrCat("rendezvous endpoint \"", endpoint, "\": ", why,
                   "; expected host[:port], [ipv6]:port or unix:/path"));
}

absl::Status CheckPort(const std::string& endpoint, absl::string_view port) {
  int value = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &value) || value < 1 || value > 65535) {
    return BadEndpoint(endpoint, "port is not a number in 1..65535");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Duration JitteredBackoff(const BackoffOptions& backoff, int attempt) {
  thread_local absl::BitGen random;
  absl::Duration cap = backoff.initial;
  for (int i = 0; i < attempt && cap < backoff.max; ++i) cap *= 2;
  cap = std::min(cap, backoff.max);
  if (cap <= absl::ZeroDuration()) return absl::ZeroDuration();
  return absl::Nanoseconds(
      absl::Uniform<int64_t>(absl::IntervalClosed, random, 0, absl::ToInt64Nanoseconds(cap)));
}

absl::StatusOr<std::string> NormalizeEndpoint(const std::string& endpoint) {
  if (absl::StartsWith(endpoint, "unix:")) {
    if (endpoint.size() == 5) return BadEndpoint(endpoint, "empty socket path");
    return endpoint;
  }
  if (endpoint.empty()) return BadEndpoint(endpoint, "empty");
  for (char c : endpoint) {
    if (absl::ascii_isspace(c) || c == '/') {
      return BadEndpoint(endpoint, "contains a space or '/'");
    }
  }
  const std::string default_port = absl::StrCat(kDefaultRendezvousPort);
  if (endpoint[0] == '[') {  // [v6]:port or [v6]
    size_t close = endpoint.find(']');
    if (close == std::string::npos || close == 1) {
      return BadEndpoint(endpoint, "unterminated or empty [ipv6] host");
    }
    std::string rest = endpoint.substr(close + 1);
    if (rest.empty()) return endpoint + ":" + default_port;
    if (rest[0] != ':') return BadEndpoint(endpoint, "junk after ']'");
    absl::Status port = CheckPort(endpoint, rest.substr(1));
    if (!port.ok()) return port;
    return endpoint;
  }
  size_t colons = std::count(endpoint.begin(), endpoint.end(), ':');
  if (colons > 1) {  // a bare IPv6 address: no port possible
    return "[" + endpoint + "]:" + default_port;
  }
  size_t colon = endpoint.find(':');
  if (colon == 0) return BadEndpoint(endpoint, "empty host");
  if (colon == std::string::npos) return endpoint + ":" + default_port;
  absl::Status port = CheckPort(endpoint, endpoint.substr(colon + 1));
  if (!port.ok()) return port;
  return endpoint;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", what, " \"", path, "\": expected a readable file"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("error reading ", what, " \"", path, "\""));
  }
  return contents.str();
}

// ---------------------------------------------------------------- Cancellation

void Cancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (active_ != nullptr) active_->TryCancel();
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool Cancellation::SleepUntil(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&cancelled_), deadline);
  return !cancelled_;
}

bool Cancellation::Register(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  active_ = context;
  return true;
}

void Cancellation::Unregister(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (active_ == context) active_ = nullptr;
}

}  // namespace muster::rdzv
