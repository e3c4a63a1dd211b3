#include "worker/config/reader.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/config/scalars.h"
#include "worker/config/walk.h"

namespace muster::worker::config_detail {
namespace {

// Edit distance, for "did you mean" on an unknown key.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

bool ByLength(const std::string& a, const std::string& b) { return a.size() < b.size(); }

// Whether the key at `entry` is the very node of a key before it in `map`:
// an alias (`*k`) of that key's anchor (`&k steps: 30`).
bool IsAliasOfEarlierKey(const YAML::Node& map, YAML::const_iterator entry) {
  for (auto it = map.begin(); it != entry; ++it) {
    if (it->first.is(entry->first)) return true;
  }
  return false;
}

}  // namespace

template <typename S>
absl::Status ConfigReader::ReadMap(const YAML::Node& map, const std::string& prefix, int line,
                                   S* out) {
  if (map.IsNull()) return absl::OkStatus();  // an empty section keeps the defaults
  if (!map.IsMap()) {
    return Error(line, prefix, absl::StrCat("expected a map, got ", Describe(map)));
  }
  std::vector<std::string> known;
  for (const Field<S>& field : Table<S>::kFields) known.emplace_back(field.key);
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node key = it->first;
    const int key_line = key.Mark().line + 1;
    if (!key.IsScalar()) {
      return Error(key_line, prefix, absl::StrCat("expected a key, got ", Describe(key)));
    }
    const std::string path = prefix.empty() ? key.Scalar() : prefix + "." + key.Scalar();
    const Field<S>* field = nullptr;
    for (const Field<S>& candidate : Table<S>::kFields) {
      if (candidate.key == key.Scalar()) field = &candidate;
    }
    // Unknown before duplicate: a dotted key ("optim.lr" at the top) has
    // the path of a real field, and was called a duplicate of it.
    if (field == nullptr && key.Scalar().find('.') != std::string::npos) {
      const std::string& dotted = key.Scalar();
      const size_t dot = dotted.rfind('.');
      return Error(key_line, path,
                   absl::StrCat("unknown key; a key is one name, not a dotted path: write '",
                                dotted.substr(dot + 1), ":' under '", dotted.substr(0, dot),
                                ":' (known keys", prefix.empty() ? "" : " in " + prefix, ": ",
                                absl::StrJoin(known, ", "), ")"));
    }
    if (field != nullptr) {
      auto [seen, inserted] = lines_.emplace(path, key_line);
      if (!inserted && IsAliasOfEarlierKey(map, it)) {
        // yaml-cpp gives an alias (`*k : 40`) its anchor's position: the
        // value's, when it has one of its own, is where the alias is.
        const int value_line = LineOf(it->second, seen->second);
        return Error(
            value_line > seen->second ? value_line : key_line, path,
            absl::StrCat("duplicate key, an alias of the key first set on line ", seen->second));
      }
      if (!inserted) {
        return Error(key_line, path,
                     absl::StrCat("duplicate key (first set on line ", seen->second, ")"));
      }
    }
    if (field == nullptr) {
      std::string what = "unknown key";
      const std::string* closest = nullptr;
      const size_t limit = std::max<size_t>(2, key.Scalar().size() / 3);
      size_t best = limit + 1;
      for (const std::string& candidate : known) {
        size_t distance = EditDistance(key.Scalar(), candidate);
        // A key that extends a known one or cuts it short ("optimizer" for
        // "optim") is near whatever its edit distance.
        const std::string& shorter = std::min(key.Scalar(), candidate, ByLength);
        const std::string& longer = std::max(key.Scalar(), candidate, ByLength);
        if (shorter.size() >= 3 && shorter.size() < longer.size() &&
            longer.compare(0, shorter.size(), shorter) == 0) {
          distance = std::min(distance, limit);
        }
        if (distance < best) best = distance, closest = &candidate;
      }
      if (closest) absl::StrAppend(&what, "; did you mean '", *closest, "'?");
      absl::StrAppend(&what, " (known keys", prefix.empty() ? "" : " in " + prefix, ": ",
                      absl::StrJoin(known, ", "), ")");
      return Error(key_line, path, what);
    }
    const YAML::Node value = it->second;
    const int value_line = LineOf(value, key_line);
    absl::Status status = std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            return ReadMap(value, path, value_line, &(out->*member));
          } else {
            if (value.IsScalar()) texts_[path] = value.Scalar();
            std::optional<std::string> what = ReadScalar(value, &(out->*member));
            return what ? Error(value_line, path, *what) : absl::OkStatus();
          }
        },
        field->member);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status ConfigReader::Read(const YAML::Node& root, TrainConfig* config) {
  if (root.IsNull()) {
    return Error(1, "", "empty file; expected a map of sections (model, data, optim, ...)");
  }
  if (!root.IsMap()) {
    return Error(LineOf(root, 1), "",
                 absl::StrCat("expected a map of sections at the top level, got ", Describe(root)));
  }
  return ReadMap(root, "", 1, config);
}

}  // namespace muster::worker::config_detail
