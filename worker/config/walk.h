// The templates that walk train.yaml's field tables (fields.h; private to
// //worker/config): each field's own check, ConfigToYaml's writer,
// operator==, a visit of every scalar, and ConfigFields()'s rows.
#pragma once

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "worker/config/config.h"
#include "worker/config/fields.h"
#include "worker/config/scalars.h"

namespace muster::worker::config_detail {

template <typename M>
struct PointeeOf;
template <typename S, typename T>
struct PointeeOf<T S::*> {
  using type = T;
};
template <typename M>
using Pointee = typename PointeeOf<M>::type;
template <typename T>
constexpr bool kIsSection =
    std::is_class_v<T> && !std::is_same_v<T, std::string> && !std::is_same_v<T, std::vector<int>>;

inline std::vector<std::string> Words(const Rule& rule) {
  if (rule.words.empty()) return {};
  return absl::StrSplit(rule.words, '|');
}
inline bool IsWord(const Rule& rule, const std::string& value) {
  const std::vector<std::string> words = Words(rule);
  return std::find(words.begin(), words.end(), value) != words.end();
}

// A field's type as docs/yaml-schema.md names it.
template <typename T>
std::string TypeName(const Rule& rule) {
  if constexpr (std::is_same_v<T, double>) {
    return "number";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "boolean";
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return "list of integers";
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (rule.path == PathKind::kGlob) return "string (glob)";
    if (rule.path == PathKind::kPath) return "string (path)";
    return "string";
  } else {
    return "integer";
  }
}

// "a, b or c"
inline std::string JoinOr(const std::vector<std::string>& items) {
  if (items.size() < 2) return absl::StrJoin(items, "");
  return absl::StrCat(absl::StrJoin(items.begin(), items.end() - 1, ", "), " or ", items.back());
}

// What is wrong with a field's own value, or nothing. `written` is the
// value as the file wrote it ("" if it did not), which messages quote: a
// number read as another ("1e-400" is 0) is shown as the user wrote it.
template <typename T>
std::optional<std::string> CheckValue(const Rule& rule, const T& value,
                                      const std::string& written) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!rule.required.empty() && value.empty()) {
      return absl::StrCat("missing; expected ", rule.required);
    }
    if (rule.words.empty() || IsWord(rule, value)) return std::nullopt;
    if (!rule.or_else.empty() && !value.empty()) return std::nullopt;
    if (!rule.noun.empty()) {
      return absl::StrCat("unknown ", rule.noun, " '", value, "'; known ", rule.nouns, ": ",
                          absl::StrJoin(Words(rule), ", "));
    }
    std::vector<std::string> expected = Words(rule);
    if (!rule.or_else.empty()) expected.emplace_back(rule.or_else);
    return absl::StrCat("expected ", JoinOr(expected), ", got '", value, "'");
  } else if constexpr (std::is_same_v<T, bool>) {
    return std::nullopt;  // both values are possible; the reader checked the type
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return std::nullopt;  // parallel.pp_split: its checks involve other fields (Validate)
  } else {
    const double number = static_cast<double>(value);
    const std::string shown = written.empty() ? absl::StrCat(value) : written;
    switch (rule.bound) {
      case Rule::Bound::kNone:
        break;
      case Rule::Bound::kPositive:
        if (!(number > 0)) return absl::StrCat("must be > 0, got ", shown);
        break;
      case Rule::Bound::kNonNegative:
        if (!(number >= 0)) return absl::StrCat("must be >= 0, got ", shown);
        break;
      case Rule::Bound::kFraction:
        if (number < 0 || number >= 1) {
          return absl::StrCat("expected a value in [0, 1), got ", shown);
        }
        break;
    }
    if (rule.at_least > 0 && number < rule.at_least) {
      return absl::StrCat(shown, " is less than ", rule.at_least, ", ", rule.at_least_why);
    }
    if (rule.at_most > 0 && number > static_cast<double>(rule.at_most)) {
      return absl::StrCat(shown, " is more than ", rule.at_most, ", ", rule.at_most_why);
    }
    if (rule.fp32) {
      // What the optimizer computes with: a value that the 32-bit float
      // does not hold would train with another (an lr of 1e-50 is 0).
      const float single = static_cast<float>(number);
      if (number != 0 && single == 0) {
        return absl::StrCat(shown,
                            " is 0 as the 32-bit float the optimizer computes in; the smallest "
                            "positive one is about 1.4e-45");
      }
      if (std::isinf(single)) {
        return absl::StrCat(shown,
                            " is beyond the largest 32-bit float, which the optimizer computes "
                            "in (about 3.4e38)");
      }
      if (rule.bound == Rule::Bound::kFraction && single >= 1) {
        return absl::StrCat(shown,
                            " is 1 as the 32-bit float the optimizer computes in; expected a "
                            "value in [0, 1)");
      }
    }
    return std::nullopt;
  }
}

template <typename S>
void WriteYaml(const S& config, const std::string& indent, std::string* out) {
  for (const Field<S>& field : Table<S>::kFields) {
    std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            absl::StrAppend(out, indent, field.key, ":\n");
            WriteYaml(config.*member, indent + "  ", out);
          } else {
            absl::StrAppend(out, indent, field.key, ": ", WriteScalar(config.*member), "\n");
          }
        },
        field.member);
  }
}

template <typename S>
bool Equal(const S& a, const S& b) {
  for (const Field<S>& field : Table<S>::kFields) {
    const bool same = std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            return Equal(a.*member, b.*member);
          } else {
            return a.*member == b.*member;
          }
        },
        field.member);
    if (!same) return false;
  }
  return true;
}

// Calls fn(path, rule, value&) for every scalar field of `config`, in table order.
template <typename S, typename Fn>
void ForEachScalar(S& config, const std::string& prefix, const Fn& fn) {
  for (const Field<std::remove_const_t<S>>& field : Table<std::remove_const_t<S>>::kFields) {
    const std::string path = absl::StrCat(prefix, field.key);
    std::visit(
        [&](auto member) {
          if constexpr (kIsSection<Pointee<decltype(member)>>) {
            ForEachScalar(config.*member, path + ".", fn);
          } else {
            fn(path, field.rule, config.*member);
          }
        },
        field.member);
  }
}

// ConfigFields() for struct S, reached from a TrainConfig through `access`.
template <typename S, typename Access>
void ListFields(const std::string& prefix, const Access& access, std::vector<ConfigField>* out) {
  static const TrainConfig kDefaults;
  for (const Field<S>& field : Table<S>::kFields) {
    const std::string path = absl::StrCat(prefix, field.key);
    std::visit(
        [&](auto member) {
          using T = Pointee<decltype(member)>;
          if constexpr (kIsSection<T>) {
            auto section = [ access, member ](auto& config) -> auto& {
              return access(config).*member;
            };
            ListFields<T>(path + ".", section, out);
          } else {
            ConfigField listed;
            listed.path = path;
            listed.type = TypeName<T>(field.rule);
            listed.default_text = WriteScalar(access(kDefaults).*member);
            listed.description = std::string(field.doc);
            listed.required = !field.rule.required.empty();
            listed.words = Words(field.rule);
            listed.get = [access, member](const TrainConfig& config) {
              return WriteScalar(access(config).*member);
            };
            listed.set = [access, member, path](const std::string& yaml_value,
                                                TrainConfig* config) {
              YAML::Node node;
              try {
                node = YAML::Load(yaml_value);
              } catch (const YAML::Exception& error) {
                return absl::InvalidArgumentError(
                    absl::StrCat(path, ": invalid yaml: ", error.msg));
              }
              T value;
              if (std::optional<std::string> what = ReadScalar(node, &value)) {
                return absl::InvalidArgumentError(absl::StrCat(path, ": ", *what));
              }
              access(*config).*member = std::move(value);
              return absl::OkStatus();
            };
            out->push_back(std::move(listed));
          }
        },
        field.member);
  }
}

}  // namespace muster::worker::config_detail
