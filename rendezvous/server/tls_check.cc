#include "rendezvous/server/tls_check.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "rendezvous/server/auth.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;

BioPtr MemoryBio(const std::string& contents) {
  return BioPtr(BIO_new_mem_buf(contents.data(), static_cast<int>(contents.size())));
}

std::string OpenSslReason(unsigned long error) {
  const char* reason = ERR_reason_error_string(error);
  return reason != nullptr ? reason : absl::StrCat("OpenSSL error ", error);
}

// "Jan  1 00:00:00 2001 GMT"
std::string TimeText(const ASN1_TIME* time) {
  BioPtr out(BIO_new(BIO_s_mem()));
  ASN1_TIME_print(out.get(), time);
  char* data = nullptr;
  long size = BIO_get_mem_data(out.get(), &data);
  return std::string(data, size > 0 ? static_cast<size_t>(size) : 0);
}

}  // namespace

absl::Status CheckClientCaLoads(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFileForServer(path, "TLS client CA");
  if (!contents.ok()) return contents.status();
  BioPtr bio = MemoryBio(*contents);
  ERR_clear_error();
  int loaded = 0;
  // The loop gRPC's x509_store_load_certs runs: read until the first
  // failure, which must be "no more PEM" after at least one certificate.
  while (X509Ptr cert{PEM_read_bio_X509_AUX(bio.get(), nullptr, nullptr, nullptr)}) ++loaded;
  const unsigned long error = ERR_peek_last_error();
  ERR_clear_error();
  if (loaded > 0 && ERR_GET_LIB(error) == ERR_LIB_PEM &&
      ERR_GET_REASON(error) == PEM_R_NO_START_LINE) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "TLS client CA file '", path, "' does not load: ",
      loaded == 0 ? "no certificate" : absl::StrCat("after ", loaded, " certificate(s)"), " (",
      OpenSslReason(error), ")"));
}

void WarnIfCertificateOutOfDate(const std::string& cert_path) {
  absl::StatusOr<std::string> contents = ReadFileForServer(cert_path, "TLS certificate");
  if (!contents.ok()) return;
  BioPtr bio = MemoryBio(*contents);
  X509Ptr cert{PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)};
  ERR_clear_error();
  if (cert == nullptr) return;
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    spdlog::warn("rendezvous: TLS certificate '{}' expired on {}; clients will refuse it",
                 cert_path, TimeText(X509_get0_notAfter(cert.get())));
  } else if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) > 0) {
    spdlog::warn("rendezvous: TLS certificate '{}' is not valid until {}; clients will refuse it",
                 cert_path, TimeText(X509_get0_notBefore(cert.get())));
  }
}

}  // namespace muster::rdzv
