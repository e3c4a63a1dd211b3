#include "launcher/failures.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace muster::launcher {

ErrorReport ReadErrorFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::stringstream text;
  text << in.rdbuf();
  if (absl::StripAsciiWhitespace(text.str()).empty()) return {};
  // JSON is YAML, and yaml-cpp is already a dependency of ours.
  try {
    YAML::Node root = YAML::Load(text.str());
    YAML::Node message = root["message"];
    if (message.IsScalar()) return {message.as<std::string>(), true};
    if (message.IsMap() && message["message"].IsScalar()) {
      ErrorReport report{message["message"].as<std::string>(), true};
      YAML::Node extra = message["extraInfo"];
      if (extra.IsMap() && extra["restartable"].IsScalar()) {
        report.restartable = extra["restartable"].as<std::string>() != "false";
      }
      return report;
    }
  } catch (const YAML::Exception&) {
  }
  return {absl::StrCat("(unreadable error file ", path, ")"), true};
}

namespace {

// `text` as a JSON string. Our own: absl has no JSON writer, and yaml-cpp's
// emitter writes YAML's escapes (\x01), which JSON does not take.
std::string JsonQuoted(absl::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace

std::string ParentErrorReport(const std::string& worker_error_file, const std::string& message,
                              absl::Time when) {
  if (!worker_error_file.empty()) {
    std::ifstream in(worker_error_file);
    std::stringstream text;
    text << in.rdbuf();
    if (in && !absl::StripAsciiWhitespace(text.str()).empty()) return text.str();
  }
  return absl::StrCat("{\"message\": {\"message\": ", JsonQuoted(message),
                      ", \"extraInfo\": {\"timestamp\": \"", absl::ToUnixSeconds(when), "\"}}}\n");
}

std::string FormatFailureTable(const std::vector<WorkerFailure>& failures) {
  std::string table = absl::StrFormat("%-24s %-20s %6s %-22s %8s  %s\n", "time", "host", "rank",
                                      "exit", "pid", "message");
  for (const WorkerFailure& failure : failures) {
    // First line of the message only: tracebacks belong in the log files.
    std::string message = failure.message.substr(0, failure.message.find('\n'));
    if (message.empty()) {
      if (!failure.stderr_log.empty()) {
        message = absl::StrCat("(no error file; see its stderr in ", failure.stderr_log, ")");
      } else if (failure.on_console) {
        message = "(no error file; see the worker's stderr)";
      } else {
        message =
            "(no error file; its stderr was neither shown, for --local_ranks_filter, nor "
            "redirected to a file)";
      }
    }
    table += absl::StrFormat(
        "%-24s %-20s %6d %-22s %8d  %s\n",
        absl::FormatTime("%Y-%m-%d %H:%M:%E3S", failure.time, absl::LocalTimeZone()), failure.host,
        failure.global_rank, failure.exit.Describe(), failure.pid, message);
    if (!failure.error_file.empty()) {
      table += absl::StrFormat("%-24s %-20s %6s error file: %s\n", "", "", "", failure.error_file);
    }
  }
  return table;
}

}  // namespace muster::launcher
