#include "rendezvous/common/credentials.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace muster::rdzv {

absl::Status CheckHeaderValue(absl::string_view value, const std::string& what) {
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c > 0x7E) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has byte 0x%02x at offset %d; a token or secret must be printable ASCII on one line "
          "(it travels as a gRPC header)",
          what, c, i));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ParseTokenFile(const std::string& contents,
                                                        const std::string& path) {
  std::vector<std::string> tokens;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    absl::Status sendable =
        CheckHeaderValue(line, absl::StrCat("token file '", path, "', line ", number, ","));
    if (!sendable.ok()) return sendable;
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file '", path, "' holds no token; expected a bearer token a line"));
  }
  return tokens;
}

}  // namespace muster::rdzv
