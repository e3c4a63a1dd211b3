#include "rendezvous/server/auth.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "rendezvous/common/credentials.h"
#include "rendezvous/common/watched_file.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

constexpr char kBearerPrefix[] = "bearer ";

// The first value of `key` in the client's metadata, if any.
bool FindMetadata(const grpc::ServerContextBase& context, const char* key, std::string* value) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(key);
  if (it == metadata.end()) return false;
  value->assign(it->second.data(), it->second.size());
  return true;
}

// gRPC only reports a bad PEM file when the listener fails to start, with
// no file name; a cheap look at the markers lets us name the file up front.
absl::Status ExpectPem(const std::string& contents, const std::string& marker,
                       const std::string& what, const std::string& path) {
  if (contents.find(marker) == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file '", path, "' is not PEM; expected '", marker, "'"));
  }
  return absl::OkStatus();
}

// gRPC's log while the check below runs: the throwaway server's own
// complaints ("Invalid private key", or that the client asked for a server
// name the certificate lacks) are what the check turns into one error that
// names the files, or noise when the pair is fine.
void DropGrpcLog(gpr_log_func_args*) {}

// Whether a TLS handshake can be made with this certificate and key: on a
// throwaway server on the loopback interface, by a client that does not
// check the certificate, only that the server proves it holds the key.
// Why: gRPC, given a key that is not the certificate's, starts serving
// anyway and fails every handshake after, logging "Invalid private key"
// without the files' names; comparing the key with the certificate ourselves
// needs OpenSSL's API, which is outside this project's libraries. A
// loopback that cannot be bound skips the check rather than refuse a server
// that may be fine. Bounded by `deadline`.
absl::Status CheckKeyMatchesCertificate(const std::string& cert, const std::string& key,
                                        const TlsFiles& files, absl::Duration deadline) {
  // gRPC starts no server without a service; this one answers UNIMPLEMENTED.
  grpc::CallbackGenericService no_service;
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&no_service);
  auto provider = std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
      std::vector<grpc::experimental::IdentityKeyCertPair>{{key, cert}});
  grpc::experimental::TlsServerCredentialsOptions server_options(provider);
  server_options.watch_identity_key_cert_pairs();
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::experimental::TlsServerCredentials(server_options),
                           &port);
  gpr_set_log_function(DropGrpcLog);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  grpc_connectivity_state state = GRPC_CHANNEL_SHUTDOWN;
  if (server != nullptr && port != 0) {
    grpc::experimental::TlsChannelCredentialsOptions client_options;
    client_options.set_verify_server_certs(false);
    client_options.set_check_call_host(false);
    client_options.set_certificate_verifier(
        std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
    std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port), grpc::experimental::TlsCredentials(client_options));
    const auto until = absl::ToChronoTime(absl::Now() + deadline);
    state = channel->GetState(/*try_to_connect=*/true);
    while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
           channel->WaitForStateChange(state, until)) {
      state = channel->GetState(/*try_to_connect=*/true);
    }
    server->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  gpr_set_log_function(nullptr);  // gRPC's default again
  if (server == nullptr || port == 0) {
    spdlog::warn("could not check that TLS key '{}' matches certificate '{}': no loopback port",
                 files.key_file, files.cert_file);
    return absl::OkStatus();
  }
  if (state == GRPC_CHANNEL_READY) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "TLS key file '", files.key_file, "' and certificate file '", files.cert_file,
      "' make no TLS handshake (tried on a loopback port before serving): is the key the "
      "certificate's own?"));
}

}  // namespace

// The token file and what was last read from it (see FromFile).
struct TokenChecker::Source {
  absl::Mutex mu;
  WatchedFile file ABSL_GUARDED_BY(mu);
  std::shared_ptr<const std::vector<std::string>> tokens ABSL_GUARDED_BY(mu);

  explicit Source(WatchedFile watched) : file(std::move(watched)) {}

  // The tokens accepted now, after looking at the file if it is time to.
  std::shared_ptr<const std::vector<std::string>> Current() {
    absl::MutexLock lock(&mu);
    std::optional<absl::StatusOr<std::string>> changed = file.Changed("token file");
    if (!changed.has_value()) return tokens;
    absl::StatusOr<std::vector<std::string>> parsed =
        changed->ok() ? ParseTokenFile(**changed, file.path()) : changed->status();
    if (!parsed.ok()) {
      spdlog::error("rendezvous: {} (changed); still accepting the {} token(s) read before",
                    std::string(parsed.status().message()), tokens->size());
      return tokens;
    }
    spdlog::info("rendezvous: token file '{}' changed: {} token(s) accepted now, {} before",
                 file.path(), parsed->size(), tokens->size());
    tokens = std::make_shared<const std::vector<std::string>>(*std::move(parsed));
    return tokens;
  }
};

absl::StatusOr<std::string> ReadFileForServer(const std::string& path, const std::string& what) {
  return ReadWholeFile(path, what + " file");
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Walk the longer length so the time does not reveal a matching prefix.
  size_t length = std::max(a.size(), b.size());
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < length; ++i) {
    unsigned char x = i < a.size() ? a[i] : 0;
    unsigned char y = i < b.size() ? b[i] : 0;
    difference |= x ^ y;
  }
  return difference == 0;
}

absl::StatusOr<TokenChecker> TokenChecker::FromFile(const std::string& token_file,
                                                    absl::Duration refresh) {
  if (token_file.empty()) return TokenChecker();
  WatchedFile file(token_file, refresh);
  absl::StatusOr<std::string> contents = file.Read("token file");
  if (!contents.ok()) return contents.status();
  absl::StatusOr<std::vector<std::string>> tokens = ParseTokenFile(*contents, token_file);
  if (!tokens.ok()) return tokens.status();
  auto source = std::make_shared<Source>(std::move(file));
  absl::MutexLock lock(&source->mu);
  source->tokens = std::make_shared<const std::vector<std::string>>(*std::move(tokens));
  return TokenChecker(std::move(source));
}

absl::Status TokenChecker::Check(const grpc::ServerContextBase& context) const {
  if (source_ == nullptr) return absl::OkStatus();
  std::string header;
  if (!FindMetadata(context, "authorization", &header)) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  return CheckAuthorization(header);
}

absl::Status TokenChecker::CheckAuthorization(const std::string& header) const {
  if (source_ == nullptr) return absl::OkStatus();
  if (header.empty()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' header");
  }
  if (header.size() < sizeof(kBearerPrefix) - 1 ||
      !absl::StartsWithIgnoreCase(header, kBearerPrefix)) {
    return absl::UnauthenticatedError(
        "malformed authorization metadata; expected 'Bearer <token>'");
  }
  std::string presented(absl::StripAsciiWhitespace(header.substr(sizeof(kBearerPrefix) - 1)));
  // Every token is compared, whichever matches: the time says nothing
  // about which one did.
  bool matched = false;
  for (const std::string& token : *source_->Current()) {
    matched |= ConstantTimeEquals(presented, token);
  }
  if (!matched) return absl::UnauthenticatedError("invalid bearer token");
  return absl::OkStatus();
}

std::string PresentedJobSecret(const grpc::ServerContextBase& context) {
  std::string secret;
  FindMetadata(context, kJobSecretMetadata, &secret);
  return secret;
}

std::string CallerIdentity(const grpc::ServerContextBase& context) {
  return PresentedJobSecret(context);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const TlsFiles& files, absl::Duration refresh,
    const std::function<absl::StatusOr<TlsFiles>()>& watched) {
  if (files.cert_file.empty() && files.key_file.empty()) {
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError("a TLS client CA needs a TLS certificate and key as well");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate file and a key file");
  }
  absl::StatusOr<std::string> cert = ReadFileForServer(files.cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFileForServer(files.key_file, "TLS key");
  if (!key.ok()) return key.status();
  absl::Status pem = ExpectPem(*cert, "BEGIN CERTIFICATE", "TLS certificate", files.cert_file);
  if (!pem.ok()) return pem;
  pem = ExpectPem(*key, "PRIVATE KEY", "TLS key", files.key_file);
  if (!pem.ok()) return pem;

  if (!files.client_ca_file.empty()) {
    absl::StatusOr<std::string> client_ca =
        ReadFileForServer(files.client_ca_file, "TLS client CA");
    if (!client_ca.ok()) return client_ca.status();
    pem = ExpectPem(*client_ca, "BEGIN CERTIFICATE", "TLS client CA", files.client_ca_file);
    if (!pem.ok()) return pem;
  }
  absl::Status pair = CheckKeyMatchesCertificate(*cert, *key, files, absl::Seconds(10));
  if (!pair.ok()) return pair;
  // gRPC's own watcher re-reads the files on its thread and hands new
  // handshakes the new pair while connections made go on; given copies
  // that only ever hold a set that loaded (TlsMirror), a bad change to the
  // files keeps the set before.
  TlsFiles read = files;
  if (watched) {
    absl::StatusOr<TlsFiles> copies = watched();
    if (!copies.ok()) return copies.status();
    read = *std::move(copies);
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      read.key_file, read.cert_file, read.client_ca_file, WatcherSeconds(refresh));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!files.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace muster::rdzv
