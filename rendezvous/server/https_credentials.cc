#include "rendezvous/server/https_credentials.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

struct OpenSslFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
  void operator()(X509* cert) const { X509_free(cert); }
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
  void operator()(X509_STORE* store) const { X509_STORE_free(store); }
  void operator()(STACK_OF(X509) * certs) const { sk_X509_pop_free(certs, X509_free); }
  void operator()(STACK_OF(X509_NAME) * names) const {
    sk_X509_NAME_pop_free(names, X509_NAME_free);
  }
};
template <typename T>
using OpenSslPtr = std::unique_ptr<T, OpenSslFree>;

// OpenSSL's reason for the last error on this thread's queue, which it
// then clears: handshakes on this thread must not see it.
std::string TakeOpenSslError() {
  const unsigned long error = ERR_peek_last_error();
  ERR_clear_error();
  const char* reason = ERR_reason_error_string(error);
  return reason != nullptr ? reason : absl::StrCat("OpenSSL error ", error);
}

OpenSslPtr<BIO> MemoryBio(const std::string& contents) {
  return OpenSslPtr<BIO>(BIO_new_mem_buf(contents.data(), static_cast<int>(contents.size())));
}

// OpenSSL's default would ask for an encrypted key's password on the
// terminal, and block the handshake thread on it; gRPC takes no encrypted
// key either.
int NoPassword(char*, int, int, void*) { return 0; }

// Every certificate of a PEM file, in order. INVALID_ARGUMENT naming
// `what` and `path` when there is none, or something after the last one
// that is not a certificate; the loop gRPC runs on a root store.
absl::StatusOr<std::vector<OpenSslPtr<X509>>> ParseCertificates(const std::string& pem,
                                                                const std::string& what,
                                                                const std::string& path) {
  OpenSslPtr<BIO> bio = MemoryBio(pem);
  ERR_clear_error();
  std::vector<OpenSslPtr<X509>> certs;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, NoPassword, nullptr)) {
    certs.emplace_back(cert);
  }
  const unsigned long error = ERR_peek_last_error();
  const std::string reason = TakeOpenSslError();
  if (!certs.empty() && ERR_GET_LIB(error) == ERR_LIB_PEM &&
      ERR_GET_REASON(error) == PEM_R_NO_START_LINE) {
    return certs;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, " file '", path, "' does not load: ",
      certs.empty() ? "no certificate" : absl::StrCat("after ", certs.size(), " certificate(s)"),
      " (", reason, ")"));
}

}  // namespace

struct HttpsCredentials::Parsed {
  std::string cert_pem, key_pem, client_ca_pem;  // what was parsed
  uint64_t generation = 0;                       // set by HttpsCredentials
  OpenSslPtr<X509> cert;
  OpenSslPtr<STACK_OF(X509)> chain;  // the certificates after the first; may be empty
  OpenSslPtr<EVP_PKEY> key;
  OpenSslPtr<X509_STORE> client_ca;  // null without a client CA
  OpenSslPtr<STACK_OF(X509_NAME)> client_ca_names;

  // The three files' contents parsed, as set `generation`; the errors of
  // HttpsCredentials::Load.
  static absl::StatusOr<std::shared_ptr<const Parsed>> From(const TlsFiles& files,
                                                            const std::string& cert_pem,
                                                            const std::string& key_pem,
                                                            const std::string& client_ca_pem,
                                                            uint64_t generation);
};

absl::StatusOr<std::shared_ptr<const HttpsCredentials::Parsed>> HttpsCredentials::Parsed::From(
    const TlsFiles& files, const std::string& cert_pem, const std::string& key_pem,
    const std::string& client_ca_pem, uint64_t generation) {
  auto parsed = std::make_shared<Parsed>();
  parsed->generation = generation;
  parsed->cert_pem = cert_pem;
  parsed->key_pem = key_pem;
  parsed->client_ca_pem = client_ca_pem;
  absl::StatusOr<std::vector<OpenSslPtr<X509>>> certs =
      ParseCertificates(cert_pem, "TLS certificate", files.cert_file);
  if (!certs.ok()) return certs.status();
  parsed->cert = std::move(certs->front());
  parsed->chain.reset(sk_X509_new_null());
  for (size_t i = 1; i < certs->size(); ++i) {
    sk_X509_push(parsed->chain.get(), (*certs)[i].release());
  }

  OpenSslPtr<BIO> bio = MemoryBio(key_pem);
  ERR_clear_error();
  parsed->key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassword, nullptr));
  if (parsed->key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS key file '", files.key_file, "' does not load: ", TakeOpenSslError(),
                     " (a PEM private key without a password is expected)"));
  }
  if (X509_check_private_key(parsed->cert.get(), parsed->key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("TLS key file '", files.key_file,
                                                   "' does not hold the private key of certificate "
                                                   "file '",
                                                   files.cert_file, "'"));
  }

  if (files.client_ca_file.empty()) return parsed;
  absl::StatusOr<std::vector<OpenSslPtr<X509>>> authorities =
      ParseCertificates(client_ca_pem, "TLS client CA", files.client_ca_file);
  if (!authorities.ok()) return authorities.status();
  parsed->client_ca.reset(X509_STORE_new());
  parsed->client_ca_names.reset(sk_X509_NAME_new_null());
  for (const OpenSslPtr<X509>& authority : *authorities) {
    // Adding takes a reference of its own; a certificate given twice is
    // not an error.
    X509_STORE_add_cert(parsed->client_ca.get(), authority.get());
    sk_X509_NAME_push(parsed->client_ca_names.get(),
                      X509_NAME_dup(X509_get_subject_name(authority.get())));
  }
  ERR_clear_error();
  return parsed;
}

HttpsCredentials::HttpsCredentials(const TlsFiles& files, absl::Duration refresh)
    : files_(files),
      cert_file_(files.cert_file, refresh),
      key_file_(files.key_file, refresh),
      client_ca_file_(files.client_ca_file, refresh) {}

HttpsCredentials::~HttpsCredentials() = default;

absl::StatusOr<std::unique_ptr<HttpsCredentials>> HttpsCredentials::Load(const TlsFiles& files,
                                                                         absl::Duration refresh) {
  std::unique_ptr<HttpsCredentials> credentials(new HttpsCredentials(files, refresh));
  absl::MutexLock lock(&credentials->mu_);
  absl::StatusOr<std::string> cert = credentials->cert_file_.Read("TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = credentials->key_file_.Read("TLS key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> client_ca = std::string();
  if (!files.client_ca_file.empty()) client_ca = credentials->client_ca_file_.Read("TLS client CA");
  if (!client_ca.ok()) return client_ca.status();
  absl::StatusOr<std::shared_ptr<const Parsed>> parsed =
      Parsed::From(files, *cert, *key, *client_ca, /*generation=*/1);
  if (!parsed.ok()) return parsed.status();
  credentials->cert_pem_ = *std::move(cert);
  credentials->key_pem_ = *std::move(key);
  credentials->client_ca_pem_ = *std::move(client_ca);
  credentials->current_ = *std::move(parsed);
  return credentials;
}

std::shared_ptr<const HttpsCredentials::Parsed> HttpsCredentials::Current() {
  absl::MutexLock lock(&mu_);
  bool changed = false;
  absl::Status read_error;
  // Each file by itself: a rotation renames them into place one at a time.
  auto look = [&](WatchedFile& file, const char* what, std::string* pem) {
    std::optional<absl::StatusOr<std::string>> now = file.Changed(what);
    if (!now.has_value()) return;
    changed = true;
    if (now->ok()) {
      *pem = **std::move(now);
    } else if (read_error.ok()) {
      read_error = now->status();
    }
  };
  look(cert_file_, "TLS certificate", &cert_pem_);
  look(key_file_, "TLS key", &key_pem_);
  if (!files_.client_ca_file.empty()) look(client_ca_file_, "TLS client CA", &client_ca_pem_);
  if (!changed) return current_;
  // Written again as it was (a `cp` of the same file): nothing to say.
  if (read_error.ok() && cert_pem_ == current_->cert_pem && key_pem_ == current_->key_pem &&
      client_ca_pem_ == current_->client_ca_pem) {
    return current_;
  }
  absl::StatusOr<std::shared_ptr<const Parsed>> parsed =
      read_error.ok()
          ? Parsed::From(files_, cert_pem_, key_pem_, client_ca_pem_, current_->generation + 1)
          : read_error;
  if (!parsed.ok()) {
    spdlog::warn("rendezvous: the gRPC port and /metrics keep the TLS credentials they had: {}",
                 std::string(parsed.status().message()));
    return current_;
  }
  spdlog::info(
      "rendezvous: the gRPC port and /metrics serve the TLS files '{}' and '{}' as they are now",
      files_.cert_file, files_.key_file);
  current_ = *std::move(parsed);
  return current_;
}

HttpsCredentials::Accepted HttpsCredentials::Now() {
  std::shared_ptr<const Parsed> parsed = Current();
  return {parsed->generation, parsed->cert_pem, parsed->key_pem, parsed->client_ca_pem};
}

int HttpsCredentials::OnHandshake(SSL* ssl, void* self) {
  std::shared_ptr<const Parsed> parsed = static_cast<HttpsCredentials*>(self)->Current();
  // The connection takes references of its own: a rotation during its
  // handshake frees nothing it uses.
  if (SSL_use_cert_and_key(ssl, parsed->cert.get(), parsed->key.get(), parsed->chain.get(),
                           /*override=*/1) != 1) {
    return 0;  // the handshake fails; the server serves on
  }
  if (parsed->client_ca != nullptr) {
    if (SSL_set1_verify_cert_store(ssl, parsed->client_ca.get()) != 1) return 0;
    SSL_set_client_CA_list(ssl, SSL_dup_CA_list(parsed->client_ca_names.get()));
  }
  return 1;
}

bool HttpsCredentials::Configure(SSL_CTX& context) {
  // Why OpenSSL's API and not httplib's file loading (SSLServer's file
  // constructor, SSL_CTX_use_certificate_chain_file): that fills the one
  // context every connection is made from, once. Filling it again while
  // handshakes read it would race, and a bad file would leave it half
  // changed; a set handed to each connection in the callback does neither.
  if (SSL_CTX_set_min_proto_version(&context, TLS1_2_VERSION) != 1) return false;
  // A resumed session skips the certificate callback and the client
  // certificate check: it would keep a connection on the credentials of
  // an earlier one.
  SSL_CTX_set_options(&context, SSL_OP_NO_COMPRESSION | SSL_OP_NO_TICKET | SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_session_cache_mode(&context, SSL_SESS_CACHE_OFF);
  if (SSL_CTX_set_num_tickets(&context, 0) != 1) return false;
  if (!files_.client_ca_file.empty()) {
    SSL_CTX_set_verify(&context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  SSL_CTX_set_cert_cb(&context, &HttpsCredentials::OnHandshake, this);
  return true;
}

}  // namespace muster::rdzv
