#include "worker/config/scalars.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muster::worker::config_detail {
namespace {

std::string ExactDouble(double value) {
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  std::string text(buffer, result.ptr);
  // "1.0", not "1": the field is a number, not an integer, to the reader.
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

// Double-quoted, so a glob starting with '*' is not read as an alias.
std::string Quoted(const std::string& text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char escape[8];
      snprintf(escape, sizeof(escape), "\\x%02x", static_cast<unsigned char>(ch));
      out += escape;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// yaml-cpp's tag of a scalar: "?" for a plain one, whose type is the
// reader's to decide; "!" for a quoted or block one, a string; else the
// explicit tag, the core schema's in full ("tag:yaml.org,2002:str").
constexpr char kPlainTag[] = "?";
constexpr char kStringTag[] = "!";
constexpr char kCoreTagPrefix[] = "tag:yaml.org,2002:";

// A plain scalar, or one tagged with one of the core schema's `types`
// ("int", "float"): a quoted "4" or a `!!str 4` is a string, whatever it
// spells.
bool IsScalarOf(const YAML::Node& node, std::initializer_list<const char*> types) {
  if (!node.IsScalar()) return false;
  const std::string& tag = node.Tag();
  if (tag == kPlainTag) return true;
  for (const char* type : types) {
    if (tag == absl::StrCat(kCoreTagPrefix, type)) return true;
  }
  return false;
}

// YAML 1.2's core schema number in decimal: [-+]? (.D+ | D+(.D*)?)
// ([eE][-+]?D+)?. Not hex (0x10, 0x1p-10), octal (0o20), .inf or .nan,
// which absl::SimpleAtod would read.
bool IsDecimal(std::string_view text) {
  size_t at = 0;
  auto digits = [&] {
    const size_t start = at;
    while (at < text.size() && absl::ascii_isdigit(static_cast<unsigned char>(text[at]))) ++at;
    return at - start;
  };
  if (at < text.size() && (text[at] == '-' || text[at] == '+')) ++at;
  size_t mantissa = digits();
  if (at < text.size() && text[at] == '.') {
    ++at;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
    ++at;
    if (at < text.size() && (text[at] == '-' || text[at] == '+')) ++at;
    if (digits() == 0) return false;
  }
  return at == text.size();
}

}  // namespace

// How a value looks in a message: the scalar itself, or its kind.
std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar: {
      const std::string quoted = absl::StrCat("'", node.Scalar(), "'");
      const std::string& tag = node.Tag();
      if (tag == kPlainTag) return quoted;
      if (tag == kStringTag) return absl::StrCat("the string ", quoted);
      if (absl::StartsWith(tag, kCoreTagPrefix)) {
        return absl::StrCat(quoted, " tagged !!", tag.substr(sizeof(kCoreTagPrefix) - 1));
      }
      return absl::StrCat(quoted, " tagged ", tag);
    }
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    default:
      return "nothing";
  }
}

// One line of yaml-cpp's position, 1-based; a null value's mark points past
// it, so callers pass the key's line as the fallback.
int LineOf(const YAML::Node& node, int fallback) {
  if (node.Type() == YAML::NodeType::Null || node.Mark().line < 0) return fallback;
  return node.Mark().line + 1;
}

// Each scalar type's reader: what was wrong, or nothing.
std::optional<std::string> ReadScalar(const YAML::Node& node, int* out) {
  const bool integer = IsScalarOf(node, {"int"});
  if (integer && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  int64_t wide;
  if (integer && absl::SimpleAtoi(node.Scalar(), &wide)) {
    return absl::StrCat("expected a 32-bit integer, ", Describe(node), " is out of range");
  }
  return absl::StrCat("expected an integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, uint64_t* out) {
  if (IsScalarOf(node, {"int"}) && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  return absl::StrCat("expected a non-negative integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, double* out) {
  if (IsScalarOf(node, {"float", "int"}) && IsDecimal(node.Scalar()) &&
      absl::SimpleAtod(node.Scalar(), out) && std::isfinite(*out)) {
    return std::nullopt;
  }
  return absl::StrCat("expected a number, got ", Describe(node));
}
// YAML 1.2's booleans only: yes/no/on/off (YAML 1.1) are refused rather
// than guessed at.
std::optional<std::string> ReadScalar(const YAML::Node& node, bool* out) {
  if (IsScalarOf(node, {"bool"})) {
    const std::string& text = node.Scalar();
    if (text == "true" || text == "True" || text == "TRUE") {
      *out = true;
      return std::nullopt;
    }
    if (text == "false" || text == "False" || text == "FALSE") {
      *out = false;
      return std::nullopt;
    }
  }
  return absl::StrCat("expected true or false, got ", Describe(node));
}
// A null value (`val:` with nothing after it) reads as the empty string.
std::optional<std::string> ReadScalar(const YAML::Node& node, std::string* out) {
  if (node.IsNull()) {
    out->clear();
    return std::nullopt;
  }
  if (node.IsScalar()) {
    *out = node.Scalar();
    return std::nullopt;
  }
  return absl::StrCat("expected a string, got ", Describe(node));
}

// A flow (`[4, 4]`) or block (`- 4`) sequence of integers; a null value
// (`pp_split:` with nothing after it) reads as the empty list.
std::optional<std::string> ReadScalar(const YAML::Node& node, std::vector<int>* out) {
  if (node.IsNull()) {
    out->clear();
    return std::nullopt;
  }
  if (!node.IsSequence()) return absl::StrCat("expected a list of integers, got ", Describe(node));
  std::vector<int> values;
  for (size_t i = 0; i < node.size(); ++i) {
    const YAML::Node item = node[i];
    const bool integer = IsScalarOf(item, {"int"});
    int value;
    if (integer && absl::SimpleAtoi(item.Scalar(), &value)) {
      values.push_back(value);
      continue;
    }
    int64_t wide;
    if (integer && absl::SimpleAtoi(item.Scalar(), &wide)) {
      return absl::StrCat("expected a list of 32-bit integers, entry ", i + 1, " ", Describe(item),
                          " is out of range");
    }
    return absl::StrCat("expected a list of integers, got ", Describe(item), " at entry ", i + 1);
  }
  *out = std::move(values);
  return std::nullopt;
}

// The shortest text that reads back as exactly `value`.
// Each scalar type's writer: text the reader reads back as exactly the value.
std::string WriteScalar(int value) { return absl::StrCat(value); }
std::string WriteScalar(uint64_t value) { return absl::StrCat(value); }
std::string WriteScalar(double value) { return ExactDouble(value); }
std::string WriteScalar(bool value) { return value ? "true" : "false"; }
std::string WriteScalar(const std::string& value) { return Quoted(value); }
std::string WriteScalar(const std::vector<int>& value) {
  return absl::StrCat("[", absl::StrJoin(value, ", "), "]");
}

}  // namespace muster::worker::config_detail
