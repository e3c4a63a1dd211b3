// Who may talk to the rendezvous server: the bearer tokens a call may
// present, and the TLS credentials the listener is built with. Both are
// read from files that are checked for a change every `refresh`, so an
// operator rotates a token or a certificate without restarting the server
// (docs/rendezvous.md, "Rotating credentials").
//
// The token is checked at the top of every handler rather than in a
// grpc::AuthMetadataProcessor, because gRPC 1.51 aborts when a processor is
// attached to insecure credentials.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace muster::rdzv {

// Metadata key carrying a job's secret (see proto/rendezvous.proto).
inline constexpr char kJobSecretMetadata[] = "x-muster-job-secret";

// Reads a whole file. INVALID_ARGUMENT naming `what` and the path when it
// cannot be read.
absl::StatusOr<std::string> ReadFileForServer(const std::string& path, const std::string& what);

// Checks "authorization: Bearer <token>" against the tokens of a file.
// Copies share the file and what was read from it. Thread-safe: any thread
// may call Check concurrently.
class TokenChecker {
 public:
  // No token configured: every call is allowed.
  TokenChecker() = default;

  // Reads the tokens of `token_file` (ParseTokenFile). An empty path means
  // no token. INVALID_ARGUMENT naming the file when it is unreadable or
  // holds no token. After that, a check at least `refresh` after the last
  // look at the file looks again (stat), and reads it when it changed
  // (another inode, size or modification time): the tokens it holds then
  // are the ones accepted. A changed file that cannot be read or holds no
  // token keeps the tokens read before, with an error on the server's log,
  // so that a bad edit locks no one out.
  static absl::StatusOr<TokenChecker> FromFile(const std::string& token_file,
                                               absl::Duration refresh = absl::Seconds(60));

  // OK when no token is configured or the call carries the right one.
  // UNAUTHENTICATED when the header is missing, malformed or wrong (gRPC's
  // code for "no valid credentials"); the message never echoes the token.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same check of an "authorization" header value (empty: missing), for
  // the HTTP /metrics endpoint.
  absl::Status CheckAuthorization(const std::string& header) const;

  bool enabled() const { return source_ != nullptr; }

 private:
  struct Source;
  explicit TokenChecker(std::shared_ptr<Source> source) : source_(std::move(source)) {}
  std::shared_ptr<Source> source_;  // null: no token
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
// INVALID_ARGUMENT naming the file that cannot be read or is not PEM, when
// only one of cert and key is given, or naming both when the key is not the
// certificate's (one handshake on a loopback port tells). The files are
// then watched by gRPC's FileWatcherCertificateProvider every `refresh`
// (whole seconds, at least 1): new connections get the certificate and key,
// and are checked against the client CA, that the files hold then. A pair
// that does not match, or a file that does not parse, keeps the credentials
// before.
//
// `watched`, when set, is called once the files passed these checks and
// returns the files gRPC is to watch instead (TlsMirror's copies); its
// error is returned.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsFiles& files, absl::Duration refresh = absl::Seconds(60),
    const std::function<absl::StatusOr<TlsFiles>()>& watched = nullptr);

}  // namespace muster::rdzv
