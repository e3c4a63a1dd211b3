// Start-up checks of the server's TLS files that gRPC does not make, or
// makes only when a client connects and then without naming the file.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace muster::rdzv {

// OK when `path` holds PEM certificates that all load, as gRPC loads a
// root store (at least one, and nothing after the last that fails to
// parse). INVALID_ARGUMENT naming the file and OpenSSL's reason otherwise:
// gRPC starts serving with such a CA and then refuses every client.
absl::Status CheckClientCaLoads(const std::string& path);

// One warning on the server's log when the first certificate in
// `cert_path` has expired or is not valid yet: clients refuse it, and say
// only that the handshake failed. A file that does not parse is left to
// the checks that refuse it.
void WarnIfCertificateOutOfDate(const std::string& cert_path);

}  // namespace muster::rdzv
