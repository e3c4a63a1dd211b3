// Who may talk to the rendezvous server: the bearer token every call must
// present, and the TLS credentials the listener is built with.
//
// The token is checked at the top of every handler rather than in a
// grpc::AuthMetadataProcessor, because gRPC 1.51 aborts when a processor is
// attached to insecure credentials.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace muster::rdzv {

// Metadata key carrying a job's secret (see proto/rendezvous.proto).
inline constexpr char kJobSecretMetadata[] = "x-muster-job-secret";

// Reads a whole file. INVALID_ARGUMENT naming `what` and the path when it
// cannot be read.
absl::StatusOr<std::string> ReadFileForServer(const std::string& path, const std::string& what);

// Checks "authorization: Bearer <token>". Immutable after construction, so
// any thread may call Check concurrently.
class TokenChecker {
 public:
  // No token configured: every call is allowed.
  TokenChecker() = default;

  // Reads the token from `token_file` (surrounding whitespace trimmed).
  // An empty path means no token. INVALID_ARGUMENT naming the file when it
  // is unreadable or holds only whitespace.
  static absl::StatusOr<TokenChecker> FromFile(const std::string& token_file);

  // OK when no token is configured or the call carries the right one.
  // UNAUTHENTICATED when the header is missing, malformed or wrong (gRPC's
  // code for "no valid credentials"); the message never echoes the token.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same check of an "authorization" header value (empty: missing), for
  // the HTTP /metrics endpoint.
  absl::Status CheckAuthorization(const std::string& header) const;

  bool enabled() const { return !token_.empty(); }

 private:
  explicit TokenChecker(std::string token) : token_(std::move(token)) {}
  std::string token_;
};

// The job secret the caller presented (empty if none).
std::string PresentedJobSecret(const grpc::ServerContextBase& context);

// Who a caller is, for per-tenant quotas (jobs per identity): the job
// secret it presents. The bearer token is one for the whole server, so it
// tells no two callers apart; every caller without a job secret shares the
// identity "". Memory only: never logged, never in an error message.
std::string CallerIdentity(const grpc::ServerContextBase& context);

// Compares in time that depends only on the lengths, not on where the first
// difference is.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

struct TlsFiles {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;  // set: clients must present a cert it signed
};

// Insecure credentials when cert and key are empty; TLS otherwise, and mTLS
// (REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY) with a client CA.
// INVALID_ARGUMENT naming the file that cannot be read, or when only one of
// cert and key is given.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsFiles& files);

}  // namespace muster::rdzv
