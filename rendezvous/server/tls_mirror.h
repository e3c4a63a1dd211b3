// The TLS files the gRPC port's FileWatcherCertificateProvider watches:
// copies, in a private directory, of the last set of the operator's files
// that loaded (HttpsCredentials: each file parses, the key is the
// certificate's own), not the operator's files themselves.
//
// Why: gRPC 1.51's watcher takes the files as they are when it looks. An
// empty one (a `cp` over the live certificate, caught between its truncate
// and its write) fails a gRPC assertion and aborts the server; a
// certificate without its new key (a rotation half done) or a file that
// does not parse fails every new handshake until the files are fixed. With
// the copies, a bad change keeps the set before, for gRPC as for /metrics.
//
// The copies change in one step: each set is written to a directory of its
// own and a symlink ("current") is renamed over to it, so the key and the
// certificate gRPC reads are always one set's. Each set's files get
// modification times a whole second after the set before: gRPC reads the
// key and the certificate one after the other and reads again when a
// file's time (in seconds) changed between its looks, so a switch in the
// middle is never taken half.
//
// Thread-safety: Start, then the thread it runs looks every `refresh`; the
// destructor stops it and removes the directory.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/server/auth.h"
#include "rendezvous/server/https_credentials.h"

namespace muster::rdzv {

class TlsMirror {
 public:
  // Makes the directory (in $TMPDIR, else /tmp; mode 0700, the key 0600),
  // writes the set `source` hands out now, and looks again every `refresh`.
  // UNAVAILABLE naming the directory when it cannot be made or written.
  static absl::StatusOr<std::unique_ptr<TlsMirror>> Start(std::shared_ptr<HttpsCredentials> source,
                                                          absl::Duration refresh,
                                                          bool with_client_ca);
  ~TlsMirror();

  TlsMirror(const TlsMirror&) = delete;
  TlsMirror& operator=(const TlsMirror&) = delete;

  // The copies, for gRPC to watch: "<dir>/current/cert.pem", ... (the
  // client CA's path is empty without one).
  TlsFiles files() const;

 private:
  TlsMirror(std::shared_ptr<HttpsCredentials> source, std::string dir, bool with_client_ca);
  // Writes the set as a new directory and points "current" at it.
  absl::Status Write(const HttpsCredentials::Accepted& set);
  void Run(absl::Duration refresh);

  const std::shared_ptr<HttpsCredentials> source_;
  const std::string dir_;
  const bool with_client_ca_;
  uint64_t written_ = 0;      // the generation "current" holds; Run's thread only
  int64_t last_mtime_s_ = 0;  // the seconds given to its files
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace muster::rdzv
