#include "rendezvous/server/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

}  // namespace

absl::StatusOr<std::string> ReadFileForServer(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " file '", path, "'"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("error reading ", what, " file '", path, "'"));
  }
  return contents.str();
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

absl::StatusOr<TokenChecker> TokenChecker::FromFile(const std::string& token_file) {
  if (token_file.empty()) return TokenChecker();
  absl::StatusOr<std::string> contents = ReadFileForServer(token_file, "token");
  if (!contents.ok()) return contents.status();
  std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file '", token_file, "' is empty; expected a bearer token"));
  }
  return TokenChecker(std::move(token));
}

absl::Status TokenChecker::Check(const grpc::ServerContextBase& context) const {
  if (token_.empty()) return absl::OkStatus();
  std::string header;
  if (!FindMetadata(context, "authorization", &header)) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  return CheckAuthorization(header);
}

absl::Status TokenChecker::CheckAuthorization(const std::string& header) const {
  if (token_.empty()) return absl::OkStatus();
  if (header.empty()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' header");
  }
  if (header.size() < sizeof(kBearerPrefix) - 1 ||
      !absl::StartsWithIgnoreCase(header, kBearerPrefix)) {
    return absl::UnauthenticatedError(
        "malformed authorization metadata; expected 'Bearer <token>'");
  }
  std::string presented(absl::StripAsciiWhitespace(header.substr(sizeof(kBearerPrefix) - 1)));
  if (!ConstantTimeEquals(presented, token_)) {
    return absl::UnauthenticatedError("invalid bearer token");
  }
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
    const TlsFiles& files) {
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

  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!files.client_ca_file.empty()) {
    absl::StatusOr<std::string> client_ca =
        ReadFileForServer(files.client_ca_file, "TLS client CA");
    if (!client_ca.ok()) return client_ca.status();
    pem = ExpectPem(*client_ca, "BEGIN CERTIFICATE", "TLS client CA", files.client_ca_file);
    if (!pem.ok()) return pem;
    options.pem_root_certs = *client_ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace muster::rdzv
