#include "worker/config/scalars.h"

#include <charconv>
#include <cmath>
#include <cstdio>

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

}  // namespace

// How a value looks in a message: the scalar itself, or its kind.
std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return absl::StrCat("'", node.Scalar(), "'");
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
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  int64_t wide;
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), &wide)) {
    return absl::StrCat("expected a 32-bit integer, ", Describe(node), " is out of range");
  }
  return absl::StrCat("expected an integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, uint64_t* out) {
  if (node.IsScalar() && absl::SimpleAtoi(node.Scalar(), out)) return std::nullopt;
  return absl::StrCat("expected a non-negative integer, got ", Describe(node));
}
std::optional<std::string> ReadScalar(const YAML::Node& node, double* out) {
  if (node.IsScalar() && absl::SimpleAtod(node.Scalar(), out) && std::isfinite(*out)) {
    return std::nullopt;
  }
  return absl::StrCat("expected a number, got ", Describe(node));
}
// YAML 1.2's booleans only: yes/no/on/off (YAML 1.1) are refused rather
// than guessed at.
std::optional<std::string> ReadScalar(const YAML::Node& node, bool* out) {
  if (node.IsScalar()) {
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
    int value;
    if (item.IsScalar() && absl::SimpleAtoi(item.Scalar(), &value)) {
      values.push_back(value);
      continue;
    }
    int64_t wide;
    if (item.IsScalar() && absl::SimpleAtoi(item.Scalar(), &wide)) {
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
