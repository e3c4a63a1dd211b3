// Reading one train.yaml document into a TrainConfig (private to
// //worker/config), through the field tables (fields.h).
//
// Errors: INVALID_ARGUMENT "NAME:LINE: PATH: what", naming the file, the
// line and the key path: a value of the wrong type, an unknown key (with
// the nearest known one, "did you mean"), a duplicate key, a section that
// is not a map.
#pragma once

#include <yaml-cpp/yaml.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "worker/config/config.h"

namespace muster::worker::config_detail {

// Reads one yaml document into a TrainConfig, remembering each key path's
// line so that checks across fields can point at the file.
class ConfigReader {
 public:
  explicit ConfigReader(std::string name) : name_(std::move(name)) {}

  // Control characters a value brought into `what` (a quoted "cpu\n", a
  // block scalar) are escaped: an error is one line.
  absl::Status Error(int line, const std::string& path, const std::string& what) const {
    std::string one_line;
    for (char ch : what) {
      if (static_cast<unsigned char>(ch) < 0x20) {
        one_line += absl::CEscape(std::string(1, ch));
      } else {
        one_line += ch;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ":", line, ": ", path.empty() ? "" : path + ": ", one_line));
  }

  // The line of the first of `paths` the file set, else of its section.
  int LineFor(const std::vector<std::string>& paths) const {
    for (const std::string& path : paths) {
      auto it = lines_.find(path);
      if (it != lines_.end()) return it->second;
    }
    for (const std::string& path : paths) {
      auto it = lines_.find(path.substr(0, path.find('.')));
      if (it != lines_.end()) return it->second;
    }
    return 1;
  }

  // The text the file wrote for `path`'s scalar value ("1e-400", which
  // reads as 0), or "" when the file did not set it.
  std::string TextFor(const std::string& path) const {
    auto it = texts_.find(path);
    return it == texts_.end() ? std::string() : it->second;
  }

  absl::Status Read(const YAML::Node& root, TrainConfig* config);

 private:
  template <typename S>
  absl::Status ReadMap(const YAML::Node& map, const std::string& prefix, int line, S* out);

  std::string name_;
  std::map<std::string, int> lines_;          // key path -> 1-based line of its value
  std::map<std::string, std::string> texts_;  // key path -> its scalar value as written
};

}  // namespace muster::worker::config_detail
