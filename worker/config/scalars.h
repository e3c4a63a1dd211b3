// How train.yaml's scalar values read and write (private to
// //worker/config): one reader and one writer per field type, so that what
// ConfigToYaml writes reads back as exactly the same value.
//
// Errors: a reader returns what was wrong with the node, naming what it
// expected and what it got (Describe), or nothing.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace muster::worker::config_detail {

// How a value looks in a message: the scalar itself ('4'; a quoted one as
// "the string '4'", a tagged one with its tag, "'4' tagged !!str"), or its
// kind.
std::string Describe(const YAML::Node& node);

// One line of yaml-cpp's position, 1-based; a null value's mark points past
// it, so callers pass the key's line as the fallback.
int LineOf(const YAML::Node& node, int fallback);

// Each scalar type's reader: what was wrong, or nothing. An integer, a
// number and a boolean are plain scalars (or tagged !!int, !!float,
// !!bool): a quoted "4" or a `!!str 4` is a string, which they refuse.
//   int, uint64_t   decimal, in range;
//   double          decimal ([-+]? digits, a point, an exponent: 6e-4,
//                   .5, 1), finite: not 0x10, 0x1p-10, .inf or .nan;
//   bool            YAML 1.2's true/false only (yes/no/on/off are refused
//                   rather than guessed at);
//   std::string     a null value (`key:` with nothing after it) is "";
//   std::vector<int>  a flow (`[4, 4]`) or block (`- 4`) sequence of
//                   integers; a null value is the empty list.
std::optional<std::string> ReadScalar(const YAML::Node& node, int* out);
std::optional<std::string> ReadScalar(const YAML::Node& node, uint64_t* out);
std::optional<std::string> ReadScalar(const YAML::Node& node, double* out);
std::optional<std::string> ReadScalar(const YAML::Node& node, bool* out);
std::optional<std::string> ReadScalar(const YAML::Node& node, std::string* out);
std::optional<std::string> ReadScalar(const YAML::Node& node, std::vector<int>* out);

// Each scalar type's writer: text the reader reads back as exactly the
// value (numbers in their shortest exact form, strings double-quoted).
std::string WriteScalar(int value);
std::string WriteScalar(uint64_t value);
std::string WriteScalar(double value);
std::string WriteScalar(bool value);
std::string WriteScalar(const std::string& value);
std::string WriteScalar(const std::vector<int>& value);

}  // namespace muster::worker::config_detail
