// The certificate, key and client CA of the HTTPS /metrics endpoint, read
// from the server's TLS files (the ones its gRPC port uses) and read again
// when they change, so /metrics follows a rotation without a restart, as
// gRPC's FileWatcherCertificateProvider does for the gRPC port.
//
// httplib's SSLServer reads its files once, when it is built; gRPC's
// watcher hands its pairs to gRPC alone. So this holds the parsed files
// itself and gives them to each TLS handshake from OpenSSL's certificate
// callback (Configure), which runs before the server picks a certificate.
//
// Thread-safety: Configure once, before serving; the handshake callback
// may then run on any number of threads at once.
#pragma once

#include <openssl/ssl.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/common/watched_file.h"
#include "rendezvous/server/auth.h"

namespace muster::rdzv {

class HttpsCredentials {
 public:
  // Reads and parses files.cert_file (the certificate, then any chain),
  // files.key_file and, when set, files.client_ca_file (every certificate
  // in it trusted to sign client certificates). INVALID_ARGUMENT naming the
  // file that cannot be read or parsed, or naming both when the key is not
  // the certificate's. REQUIRES: cert_file and key_file set.
  //
  // After that, a handshake at least `refresh` after the last look at the
  // files looks again (WatchedFile) and, when one changed, parses the three
  // as they are then. A set that does not load or whose key does not match
  // its certificate (a rotation half done) keeps the set before, with one
  // warning on the server's log for that change; the next change is tried
  // again.
  static absl::StatusOr<std::unique_ptr<HttpsCredentials>> Load(const TlsFiles& files,
                                                                absl::Duration refresh);
  ~HttpsCredentials();

  HttpsCredentials(const HttpsCredentials&) = delete;
  HttpsCredentials& operator=(const HttpsCredentials&) = delete;

  // Sets `context` up to serve with these credentials: TLS 1.2 or later, no
  // session resumption (each connection gets the certificate and the client
  // CA of its time), and with a client CA a client certificate that chains
  // to it is required. False when OpenSSL refuses a setting. REQUIRES: this
  // outlives every connection made with `context`.
  bool Configure(SSL_CTX& context);

  // The files' contents of the set handed out now (after a look at the
  // files when it is time for one), and a number that changes with it.
  struct Accepted {
    uint64_t generation = 0;
    std::string cert_pem;
    std::string key_pem;
    std::string client_ca_pem;  // "" without a client CA
  };
  Accepted Now();

 private:
  struct Parsed;  // OpenSSL objects; immutable once built

  HttpsCredentials(const TlsFiles& files, absl::Duration refresh);

  // What new handshakes get: the set parsed last that loaded, after a look
  // at the files when it is time for one.
  std::shared_ptr<const Parsed> Current();
  // SSL_CTX_set_cert_cb's callback: `self` is this.
  static int OnHandshake(SSL* ssl, void* self);

  const TlsFiles files_;
  absl::Mutex mu_;
  WatchedFile cert_file_ ABSL_GUARDED_BY(mu_);
  WatchedFile key_file_ ABSL_GUARDED_BY(mu_);
  WatchedFile client_ca_file_ ABSL_GUARDED_BY(mu_);  // unused without a client CA
  // The files' contents as last read, loaded or not: a pair is taken when
  // its second file arrives, whichever one that is.
  std::string cert_pem_ ABSL_GUARDED_BY(mu_);
  std::string key_pem_ ABSL_GUARDED_BY(mu_);
  std::string client_ca_pem_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Parsed> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::rdzv
