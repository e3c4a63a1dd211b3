#include "worker/trainer/config_agreement.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "worker/checkpoint/dir_lock.h"

namespace muster::worker {

std::vector<ConfigLine> ComparedConfig(const TrainConfig& config,
                                       const std::vector<ConfigLine>& resolved) {
  std::vector<ConfigLine> lines;
  for (const ConfigField& field : ConfigFields()) {
    if (field.path == "checkpoint.resume") {
      const std::string& resume = config.checkpoint.resume;
      lines.emplace_back(field.path + " (kind)",
                         resume == "auto" || resume == "never" ? resume : "a checkpoint path");
    } else if (field.type != "string (path)" && field.type != "string (glob)") {
      lines.emplace_back(field.path, field.get(config));
    }
  }
  lines.insert(lines.end(), resolved.begin(), resolved.end());
  return lines;
}

std::string ConfigLinesText(const std::vector<ConfigLine>& lines) {
  std::string text;
  for (const auto& [name, value] : lines) absl::StrAppend(&text, name, ": ", value, "\n");
  return text;
}

std::vector<ConfigLine> ParseConfigLines(const std::string& text) {
  std::vector<ConfigLine> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> split = absl::StrSplit(line, absl::MaxSplits(": ", 1));
    lines.push_back(std::move(split));
  }
  return lines;
}

std::string ConfigDifferences(const std::vector<ConfigLine>& mine,
                              const std::vector<ConfigLine>& rank0) {
  const std::map<std::string, std::string> theirs(rank0.begin(), rank0.end());
  std::vector<std::string> differences;
  std::set<std::string> seen;
  for (const auto& [name, value] : mine) {
    seen.insert(name);
    auto found = theirs.find(name);
    if (found == theirs.end()) {
      differences.push_back(absl::StrCat(name, " is ", value, " here and missing on rank 0"));
    } else if (found->second != value) {
      differences.push_back(
          absl::StrCat(name, " is ", value, " here and ", found->second, " on rank 0"));
    }
  }
  for (const auto& [name, value] : rank0) {
    if (!seen.count(name)) {
      differences.push_back(absl::StrCat(name, " is missing here and ", value, " on rank 0"));
    }
  }
  return absl::StrJoin(differences, "; ");
}

absl::Status AgreeOnConfig(parallel::Collectives& control, const std::vector<ConfigLine>& mine,
                           const std::string& source) {
  const int size = control.size(), rank = control.rank();
  if (size == 1) return absl::OkStatus();
  std::string text = ConfigLinesText(mine);
  if (absl::Status sent = control.Broadcast(&text, /*root=*/0); !sent.ok()) return sent;
  const std::string differences = ConfigDifferences(mine, ParseConfigLines(text));
  auto differing = control.LowestRankWith(!differences.empty());
  if (!differing.ok()) return differing.status();
  if (!differences.empty()) {
    const std::string host = HostName();
    return absl::InvalidArgumentError(absl::StrCat(
        "the config of rank ", rank, " (host ", host.empty() ? "?" : host, ", ",
        source.empty() ? "built in code" : source, ") differs from rank 0's: ", differences,
        ". Every rank must train with the same config: give every node rank 0's train.yaml"));
  }
  if (*differing >= 0) {
    return absl::AbortedError(
        absl::StrCat("the config of rank ", *differing, " differs from rank 0's (see its log)"));
  }
  return absl::OkStatus();
}

}  // namespace muster::worker
