#include "parallel/nccl/transport.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace muster::parallel {
namespace {

// "NET/IB/3/GDRDMA" -> "NET/IB/GDRDMA", "P2P/CUMEM/read" -> "P2P/CUMEM/read":
// the parts that are numbers (device, port) name one NIC, not a transport.
std::string TransportKind(absl::string_view via) {
  std::vector<absl::string_view> parts;
  for (absl::string_view part : absl::StrSplit(via, '/')) {
    if (!part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) continue;
    parts.push_back(part);
  }
  return absl::StrJoin(parts, "/");
}

}  // namespace

NcclTransports ParseNcclTransports(absl::string_view log) {
  NcclTransports result;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (line.find("NCCL INFO") == absl::string_view::npos) continue;
    if (const size_t at = line.find("Using network "); at != absl::string_view::npos) {
      result.network = std::string(absl::StripAsciiWhitespace(line.substr(at + 14)));
      continue;
    }
    // "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/3/GDRDMA"
    if (line.find(" Channel ") == absl::string_view::npos) continue;
    const size_t arrow = line.find(" -> "), via = line.rfind(" via ");
    if (arrow == absl::string_view::npos || via == absl::string_view::npos || via < arrow) continue;
    absl::string_view transport = absl::StripAsciiWhitespace(line.substr(via + 5));
    if (transport.empty()) continue;
    ++result.connections[TransportKind(transport)];
  }
  return result;
}

std::string DescribeNcclTransports(const NcclTransports& transports) {
  std::vector<std::pair<std::string, int>> by_count(transports.connections.begin(),
                                                    transports.connections.end());
  std::stable_sort(by_count.begin(), by_count.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string text;
  for (size_t i = 0; i < by_count.size(); ++i) {
    absl::StrAppend(&text, i == 0 ? "" : ", ", by_count[i].first, " (", by_count[i].second,
                    i == 0 ? (by_count[i].second == 1 ? " connection" : " connections") : "", ")");
  }
  if (text.empty()) text = "no connections (a world of one)";
  if (!transports.network.empty()) absl::StrAppend(&text, "; network ", transports.network);
  return text;
}

std::optional<std::string> NcclTransportLog(const std::string& dir) {
  // Any of NCCL's log settings is the user's: all of them stand, unchanged.
  for (const char* name : {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"}) {
    if (std::getenv(name) != nullptr) return std::nullopt;
  }
  const std::string path = absl::StrCat(dir, "/muster-nccl-", getpid(), ".log");
  setenv("NCCL_DEBUG", "INFO", 1);
  setenv("NCCL_DEBUG_SUBSYS", "INIT", 1);
  setenv("NCCL_DEBUG_FILE", path.c_str(), 1);
  return path;
}

}  // namespace muster::parallel
