// Credentials as the rendezvous server and its clients both read them: the
// bearer tokens of a token file, and the check that a token or job secret
// can travel as a gRPC header at all.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muster::rdzv {

// OK when `value` may be sent as a gRPC metadata value: printable ASCII,
// 0x20 to 0x7E. gRPC aborts a client that sends anything else (a failed
// assertion, not an error), so a token or secret holding a newline, a tab
// or a UTF-8 byte is refused before it is used. INVALID_ARGUMENT naming
// `what` ("token file '/etc/t', line 2") and the byte otherwise.
absl::Status CheckHeaderValue(absl::string_view value, const std::string& what);

// The tokens a token file holds: one per line, surrounding whitespace
// trimmed, empty lines and lines starting with '#' skipped. Several lines
// let a rotation accept the old token and the new one at once; a client
// sends the first. INVALID_ARGUMENT naming the file when it holds none,
// and naming the line when a token could not be sent (CheckHeaderValue).
absl::StatusOr<std::vector<std::string>> ParseTokenFile(const std::string& contents,
                                                        const std::string& path);

}  // namespace muster::rdzv
