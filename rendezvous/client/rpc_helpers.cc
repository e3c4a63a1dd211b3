// Client helpers that need no channel: endpoint parsing, file reading,
// backoff, the words for a failed connection and Cancellation (declared in
// rpc.h).
#include <algorithm>

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

// The name the server's certificate must list: tls_server_name, else the
// endpoint's host.
std::string CheckedName(const ClientOptions& options) {
  if (!options.tls_server_name.empty()) return options.tls_server_name;
  absl::StatusOr<std::string> target = NormalizeEndpoint(options.endpoint);
  if (!target.ok() || absl::StartsWith(*target, "unix:")) return options.endpoint;
  std::string host = target->substr(0, target->rfind(':'));
  if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

bool UsesTls(const ClientOptions& options) {
  return options.use_tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
         !options.tls_key_file.empty();
}

// The phrases matched are gRPC 1.51's (with OpenSSL 3) for each failure,
// seen against a real server: tests/rendezvous/client/tls_test.cc.
std::string NoConnectionMessage(const std::string& last_error, const ClientOptions& options,
                                absl::Duration waited) {
  absl::string_view cause = last_error;
  const absl::string_view marker = "last error: ";
  if (size_t at = cause.find(marker); at != absl::string_view::npos) {
    cause.remove_prefix(at + marker.size());
  }
  auto has = [&](absl::string_view phrase) { return absl::StrContains(cause, phrase); };
  const std::string server = absl::StrCat("the rendezvous server at ", options.endpoint);
  const std::string handshake = absl::StrCat("TLS handshake with ", server, " failed: ");
  const std::string grpc_said = absl::StrCat(" (gRPC: ", cause, ")");
  if (has("certificate verify failed")) {
    return absl::StrCat(
        handshake, "its certificate did not verify (certificate verify failed): ",
        options.tls_ca_file.empty()
            ? "no tls_ca is given, so it must chain to a CA this system trusts; give tls_ca, "
              "the CA that signed the server's certificate"
            : "is tls_ca the CA that signed the server's certificate, and is that "
              "certificate within its dates?",
        grpc_said);
  }
  if (has("wrong version number")) {
    return absl::StrCat(handshake,
                        "the server answered without TLS (wrong version number): it serves "
                        "plaintext; give no tls_ca, tls_cert or tls_key, or start it with "
                        "--tls-cert and --tls-key",
                        grpc_said);
  }
  if (has("Hostname Verification Check failed") || has("is not in peer certificate")) {
    return absl::StrCat(handshake, "its certificate does not name \"", CheckedName(options),
                        "\": connect by a name or address that the certificate lists", grpc_said);
  }
  // The server hung up. Under TLS 1.3 that is how it refuses the client's
  // certificate (or its absence), after the client's side of the handshake
  // is done; without TLS, how a TLS server answers a plaintext client.
  if (has("Socket closed")) {
    const char* why =
        !UsesTls(options)
            ? "before speaking gRPC: it likely serves TLS, which this client does not; "
              "give tls_ca, the CA that signed the server's certificate"
        : options.tls_cert_file.empty()
            ? "during the TLS handshake: it likely requires a client certificate (mTLS); give "
              "tls_cert and tls_key"
            : "during the TLS handshake: it likely does not trust this client's certificate; "
              "is tls_cert signed by the CA that the server's --tls-client-ca names?";
    return absl::StrCat(server, " closed the connection ", why, grpc_said);
  }
  if (has("Tls handshake failed") || has("Ssl handshake failed")) {
    return absl::StrCat(handshake, cause);
  }
  return absl::StrCat("no connection to ", server, " within ", absl::FormatDuration(waited),
                      cause.empty() ? "" : absl::StrCat(" (", cause, ")"));
}

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
