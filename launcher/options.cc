#include "launcher/options.h"

#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <set>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace muster::launcher {
namespace {

// "--nproc_per_node,--nproc-per-node" for CLI11, plus an optional short name.
std::string Names(const std::string& flag, const std::string& short_name = "") {
  std::string names = short_name.empty() ? "" : "-" + short_name + ",";
  names += "--" + flag;
  std::string dashed = absl::StrReplaceAll(flag, {{"_", "-"}});
  if (dashed != flag) names += ",--" + dashed;
  return names;
}

std::string PetName(const std::string& flag) { return "PET_" + absl::AsciiStrToUpper(flag); }

// Seconds as torchrun writes them ("600", "0.5"), or an absl duration
// ("500ms", "2s").
absl::StatusOr<absl::Duration> ParseSeconds(const std::string& key, const std::string& text) {
  double seconds = 0;
  if (absl::SimpleAtod(text, &seconds) && seconds >= 0) {
    return absl::Seconds(seconds);
  }
  absl::Duration duration;
  if (absl::ParseDuration(text, &duration) && duration >= absl::ZeroDuration()) {
    return duration;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      key, "=", text, ": expected seconds (e.g. 30 or 0.5) or a duration (e.g. 500ms)"));
}

absl::StatusOr<int> ParseSignalName(const std::string& name) {
  static const std::map<std::string, int> kSignals = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},
                                                      {"SIGHUP", SIGHUP},   {"SIGQUIT", SIGQUIT},
                                                      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}};
  auto it = kSignals.find(absl::AsciiStrToUpper(absl::StripAsciiWhitespace(name)));
  if (it == kSignals.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--signals_to_handle: unknown signal '", name,
                     "'; expected a list of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2"));
  }
  return it->second;
}

TargetKind KindOf(const LaunchOptions& options) {
  if (options.no_python) return TargetKind::kExecutable;
  if (options.run_module) return TargetKind::kPythonScript;
  if (absl::EndsWith(options.target, ".yaml") || absl::EndsWith(options.target, ".yml")) {
    return TargetKind::kYamlConfig;
  }
  // An executable file runs as it is (torchrun would hand it to python,
  // which runs an executable script the same and fails on a binary);
  // anything else is a Python program, as torchrun has it: a script without
  // the .py suffix, a zipapp, a directory with __main__.py.
  struct stat info;
  if (stat(options.target.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
      (info.st_mode & 0111) != 0) {
    return TargetKind::kExecutable;
  }
  return TargetKind::kPythonScript;
}

}  // namespace

absl::Status ParseNnodes(const std::string& text, int* min_nodes, int* max_nodes) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  int low = 0, high = 0;
  bool ok = false;
  if (parts.size() == 1) {
    ok = absl::SimpleAtoi(parts[0], &low);
    high = low;
  } else if (parts.size() == 2) {
    ok = absl::SimpleAtoi(parts[0], &low) && absl::SimpleAtoi(parts[1], &high);
  }
  if (!ok || low < 1 || high < low) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes ", text, ": expected N or MIN:MAX with 1 <= MIN <= MAX"));
  }
  *min_nodes = low;
  *max_nodes = high;
  return absl::OkStatus();
}

absl::Status ParseRdzvConf(const std::string& text, RdzvConf* conf) {
  std::set<std::string> given;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    std::string key(absl::StripAsciiWhitespace(kv.first));
    std::string value(absl::StripAsciiWhitespace(kv.second));
    auto set_duration = [&](absl::Duration* field) -> absl::Status {
      absl::StatusOr<absl::Duration> parsed = ParseSeconds("--rdzv_conf " + key, value);
      if (!parsed.ok()) return parsed.status();
      *field = *parsed;
      return absl::OkStatus();
    };
    absl::Status status;
    given.insert(key == "heartbeat_timeout" ? "lease_ttl" : key);
    if (key == "join_timeout" || key == "timeout") {  // timeout: torchrun's static backend's
      status = set_duration(&conf->join_timeout);
    } else if (key == "last_call_timeout") {
      status = set_duration(&conf->last_call_timeout);
    } else if (key == "close_timeout") {
      status = set_duration(&conf->close_timeout);
    } else if (key == "lease_ttl" || key == "heartbeat_timeout") {
      status = set_duration(&conf->lease_ttl);
    } else if (key == "keep_alive_interval") {
      status = set_duration(&conf->keep_alive_interval);
    } else if (key == "keep_alive_max_attempt") {
      if (!absl::SimpleAtoi(value, &conf->keep_alive_max_attempt) ||
          conf->keep_alive_max_attempt < 1) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "--rdzv_conf keep_alive_max_attempt=", value, ": expected an integer >= 1"));
      }
    } else if (key == "token_file") {
      conf->token_file = value;
    } else if (key == "tls_ca") {
      conf->tls_ca = value;
    } else if (key == "tls_cert") {
      conf->tls_cert = value;
    } else if (key == "tls_key") {
      conf->tls_key = value;
    } else if (key == "job_secret_file") {
      conf->job_secret_file = value;
    } else if (key == "world_size_multiple") {
      if (!absl::SimpleAtoi(value, &conf->world_size_multiple) || conf->world_size_multiple < 1) {
        status = absl::InvalidArgumentError(
            absl::StrCat("--rdzv_conf world_size_multiple=", value, ": expected an integer >= 1"));
      }
    } else if (key == "read_timeout") {
      // torchrun's TCPStore settings (c10d): checked, then without effect,
      // as the muster service is no TCPStore.
      absl::Duration unused;
      status = set_duration(&unused);
    } else if (key == "use_libuv" || key == "is_host") {
      const std::string lower = absl::AsciiStrToLower(value);
      if (lower != "1" && lower != "0" && lower != "true" && lower != "false") {
        status = absl::InvalidArgumentError(
            absl::StrCat("--rdzv_conf ", key, "=", value, ": expected true, false, 1 or 0"));
      } else if (key == "is_host") {
        conf->is_host = lower == "1" || lower == "true";
      }
    } else {
      status = absl::InvalidArgumentError(absl::StrCat(
          "--rdzv_conf: unknown key '", key,
          "'; known keys: join_timeout (or timeout), last_call_timeout, close_timeout, lease_ttl, "
          "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, token_file, "
          "tls_ca, tls_cert, tls_key, job_secret_file, world_size_multiple, is_host, "
          "read_timeout, use_libuv"));
    }
    if (!status.ok()) return status;
  }
  // torchrun's keep-alive settings: a node renews every
  // keep_alive_interval and is dead after keep_alive_max_attempt missed
  // renewals. Here the lease is what dies, so without lease_ttl those
  // two set it (interval x attempts), and without keep_alive_interval the
  // lease is renewed keep_alive_max_attempt times a ttl.
  const bool interval_given = given.count("keep_alive_interval") > 0;
  const bool ttl_given = given.count("lease_ttl") > 0;
  if (interval_given && conf->keep_alive_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--rdzv_conf keep_alive_interval: must be positive");
  }
  if (interval_given && !ttl_given) {
    conf->lease_ttl = conf->keep_alive_interval * conf->keep_alive_max_attempt;
  }
  if (conf->lease_ttl < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError(
        interval_given && !ttl_given
            ? "--rdzv_conf keep_alive_interval x keep_alive_max_attempt, the lease ttl, must be "
              "at least 0.1 s"
            : "--rdzv_conf lease_ttl: must be at least 0.1 s");
  }
  if (!interval_given) conf->keep_alive_interval = conf->lease_ttl / conf->keep_alive_max_attempt;
  if (conf->keep_alive_interval >= conf->lease_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_conf keep_alive_interval ", absl::FormatDuration(conf->keep_alive_interval),
        " is not shorter than lease_ttl ", absl::FormatDuration(conf->lease_ttl),
        ": the lease would lapse between renewals"));
  }
  if (conf->join_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--rdzv_conf join_timeout: must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<int, int>> ParseStdStreams(const std::string& text) {
  auto parse_value = [&](absl::string_view value, int* out) {
    return absl::SimpleAtoi(value, out) && *out >= 0 && *out <= 3;
  };
  std::map<int, int> result = {{-1, 0}};
  int all = 0;
  if (parse_value(text, &all)) {
    result[-1] = all;
    return result;
  }
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, ':');
    int rank = 0, value = 0;
    if (!absl::SimpleAtoi(kv.first, &rank) || rank < 0 || !parse_value(kv.second, &value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", text, "': expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or a map like 0:1,1:2"));
    }
    result[rank] = value;
  }
  return result;
}

int StreamsFor(const std::map<int, int>& setting, int local_rank) {
  auto it = setting.find(local_rank);
  if (it != setting.end()) return it->second;
  it = setting.find(-1);
  return it == setting.end() ? 0 : it->second;
}

absl::StatusOr<int> ResolveNprocPerNode(const std::string& text, int gpu_count, int cpu_count) {
  if (text == "gpu") {
    if (gpu_count == 0) {
      return absl::FailedPreconditionError(
          "--nproc_per_node gpu: no CUDA device is visible on this node");
    }
    return gpu_count;
  }
  if (text == "cpu") return cpu_count;
  if (text == "auto") return gpu_count > 0 ? gpu_count : cpu_count;
  int count = 0;
  if (!absl::SimpleAtoi(text, &count) || count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nproc_per_node ", text, ": expected a positive integer, auto, cpu or gpu"));
  }
  return count;
}

namespace {

// host[:port] or [v6]:port into master_addr and master_port (the port
// stays master_port's when the endpoint has none).
absl::Status MasterFromEndpoint(const std::string& endpoint, LaunchOptions* options) {
  std::string host = endpoint, port;
  if (absl::StartsWith(endpoint, "[")) {
    const size_t close = endpoint.find(']');
    if (close == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rdzv_endpoint ", endpoint, ": unterminated [ipv6] host"));
    }
    host = endpoint.substr(1, close - 1);
    if (close + 1 < endpoint.size()) {
      if (endpoint[close + 1] != ':') {
        return absl::InvalidArgumentError(
            absl::StrCat("--rdzv_endpoint ", endpoint, ": junk after ']'"));
      }
      port = endpoint.substr(close + 2);
    }
  } else if (std::count(endpoint.begin(), endpoint.end(), ':') == 1) {
    host = endpoint.substr(0, endpoint.find(':'));
    port = endpoint.substr(endpoint.find(':') + 1);
  }
  int number = options->master_port;
  if (!port.empty() && (!absl::SimpleAtoi(port, &number) || number < 1 || number > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv_endpoint ", endpoint, ": port is not a number in 1..65535"));
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv_endpoint ", endpoint, ": empty host"));
  }
  options->master_addr = host;
  options->master_port = number;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LaunchOptions> ParseLaunchOptions(const std::vector<std::string>& argv,
                                                 const std::map<std::string, std::string>& env) {
  LaunchOptions options;
  CLI::App app("launch: start and supervise a distributed job's workers on this node", "launch");
  app.prefix_command();  // the first unknown argument is the target
  app.set_help_flag("-h,--help", "Show this help and exit");
  // A flag given twice takes its last value, as torchrun's argparse does:
  // wrappers append overrides to a default command line.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  // PET_<FLAG> defaults, read from `env` rather than the real environment
  // so tests control them.
  auto pet = [&](const std::string& flag) -> const std::string* {
    auto it = env.find(PetName(flag));
    return it == env.end() ? nullptr : &it->second;
  };
  std::map<std::string, std::string> text;  // string-typed flags as given
  auto add_text = [&](const std::string& flag, const std::string& fallback, const std::string& help,
                      const std::string& short_name = "") {
    text[flag] = pet(flag) ? *pet(flag) : fallback;
    app.add_option(Names(flag, short_name), text[flag], help);
  };
  auto add_bool = [&](const std::string& flag, bool* field, const std::string& help,
                      const std::string& short_name = "") {
    if (const std::string* value = pet(flag)) {
      *field = (*value == "1" || absl::AsciiStrToLower(*value) == "true");
    }
    app.add_flag(Names(flag, short_name), *field, help);
  };

  add_text("nnodes", "1:1", "Number of nodes, N or MIN:MAX");
  add_text("nproc_per_node", "1", "Workers per node: N, auto, cpu or gpu");
  add_text("node_rank", "-1", "This node's rank (static backend)");
  add_text("master_addr", "127.0.0.1", "Address of node 0 (static backend)");
  add_text("master_port", "29500", "Port on node 0 (static backend)");
  add_text("rdzv_backend", "",
           "Rendezvous backend: grpc (the muster service at --rdzv_endpoint), c10d (that "
           "service, hosted by the agent on the endpoint's machine) or static (node 0 hosts it "
           "at --master_addr:--master_port); default grpc with --rdzv_endpoint, else static");
  add_text("rdzv_endpoint", "", "Rendezvous service, host[:port] (port 29400)");
  add_text("rdzv_id", "none", "Job id shared by every node of the job");
  add_text("rdzv_conf", "",
           "k=v,... : join_timeout, last_call_timeout, close_timeout, "
           "lease_ttl, keep_alive_interval, keep_alive_max_attempt, token_file, tls_*, "
           "job_secret_file, world_size_multiple, is_host (c10d)");
  add_bool("standalone", &options.standalone, "Run an embedded rendezvous server");
  add_text("max_restarts", "0", "Job-wide failure restarts before giving up");
  add_text("monitor_interval", "0.1", "Seconds between worker health checks");
  add_text("role", "default", "Role name of the workers");
  add_text("log_dir", "", "Directory for per-worker logs");
  add_text("redirects", "0", "Redirect worker streams to files: 0-3 or 0:1,1:2", "r");
  add_text("tee", "0", "Tee worker streams to files and console: 0-3 or map", "t");
  add_text("local_ranks_filter", "", "Only show these local ranks on the console: 0,2");
  add_bool("no_python", &options.no_python, "Run the target as an executable");
  add_bool("module", &options.run_module, "Run the target as a Python module", "m");
  add_text("start_method", "spawn",
           "torchrun's spawn, fork or forkserver: accepted; workers are always fresh processes");
  add_bool("run_path", &options.run_path,
           "torchrun's runpy entry point: accepted; the script runs in each worker as without it");
  add_text("local_addr", "", "Address other nodes reach this one at");
  add_text("shutdown_timeout", "30", "Seconds between SIGTERM and SIGKILL to workers");
  add_text("preempt_grace", "30",
           "Seconds workers get to save their state after SIGTERM or SIGUSR1 (preemption) "
           "before SIGKILL; replaces shutdown_timeout for those signals");
  add_text("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
           "Signals forwarded to workers before exiting");

  // `--flag=` gives the flag an empty value, as argparse does. CLI11 takes
  // an empty value as none and would take the next word instead, so that
  // `--rdzv_id=$UNSET --nnodes=2` ran a one-node job named "--nnodes=2". A
  // stand-in value goes through CLI11 and is turned back into "" (in a
  // flag) or "--flag=" (in the target's arguments, which are kept as given).
  const std::string kEmpty = "\x01launch-empty-value\x01";
  std::vector<std::string> args;
  for (auto it = argv.rbegin(); it != argv.rend() - 1; ++it) {  // CLI11 wants them reversed
    const bool empty_value =
        absl::StartsWith(*it, "-") && absl::EndsWith(*it, "=") && it->find('=') == it->size() - 1;
    args.push_back(empty_value ? *it + kEmpty : *it);
  }
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    return absl::CancelledError(app.help());
  } catch (const CLI::ParseError& error) {
    return absl::InvalidArgumentError(absl::StrReplaceAll(error.what(), {{kEmpty, ""}}));
  }

  for (auto& [flag, value] : text) {
    if (value == kEmpty) value.clear();
  }
  std::vector<std::string> rest = app.remaining();
  for (std::string& arg : rest) {
    if (absl::EndsWith(arg, "=" + kEmpty)) arg.resize(arg.size() - kEmpty.size());
  }
  // `launch [flags] -- script.py args`: "--" ends the flags, as with argparse.
  if (!rest.empty() && rest[0] == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    return absl::InvalidArgumentError(
        "missing target: expected a train.yaml, a script.py, or (with --no_python) a program");
  }
  if (absl::StartsWith(rest[0], "-")) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", rest[0]));
  }
  if (options.no_python && options.run_module) {
    return absl::InvalidArgumentError(
        "--no_python and --module exclude each other: a module is run by python");
  }
  options.target = rest[0];
  options.target_args.assign(rest.begin() + 1, rest.end());
  options.target_kind = KindOf(options);

  auto int_flag = [&](const std::string& flag, int low, int* out) -> absl::Status {
    if (!absl::SimpleAtoi(text[flag], out) || *out < low) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " ", text[flag], ": expected an integer >= ", low));
    }
    return absl::OkStatus();
  };
  auto seconds_flag = [&](const std::string& flag, absl::Duration* out) -> absl::Status {
    absl::StatusOr<absl::Duration> parsed = ParseSeconds("--" + flag, text[flag]);
    if (!parsed.ok()) return parsed.status();
    *out = *parsed;
    return absl::OkStatus();
  };

  std::vector<std::function<absl::Status()>> checks = {
      [&] { return ParseNnodes(text["nnodes"], &options.min_nodes, &options.max_nodes); },
      [&] { return int_flag("node_rank", -1, &options.node_rank); },
      [&] { return int_flag("master_port", 0, &options.master_port); },
      [&] { return int_flag("max_restarts", 0, &options.max_restarts); },
      [&] { return seconds_flag("monitor_interval", &options.monitor_interval); },
      [&] { return seconds_flag("shutdown_timeout", &options.shutdown_timeout); },
      [&] { return seconds_flag("preempt_grace", &options.preempt_grace); },
      [&] { return ParseRdzvConf(text["rdzv_conf"], &options.rdzv_conf); },
  };
  for (const auto& check : checks) {
    if (absl::Status status = check(); !status.ok()) return status;
  }
  // --standalone's service listens on a loopback port of its own choosing:
  // no other node can find it, so the job is this one node. A minimum above
  // 1 would wait out join_timeout for nodes that never come, a maximum
  // above 1 last_call_timeout before every round.
  if (options.standalone && options.min_nodes > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nnodes ", text["nnodes"],
        " with --standalone: a standalone job is one node (its rendezvous is on a loopback port "
        "no other node can reach); for more, run a rendezvous service and give --rdzv_endpoint"));
  }
  if (options.standalone) options.max_nodes = 1;
  if (options.master_port > 65535) {
    return absl::InvalidArgumentError("--master_port: expected a port in 0..65535");
  }

  options.nproc_per_node = text["nproc_per_node"];
  if (absl::Status status = ResolveNprocPerNode(options.nproc_per_node, 0, 1).status();
      absl::IsInvalidArgument(status)) {
    return status;
  }
  options.start_method = text["start_method"];
  if (options.start_method != "spawn" && options.start_method != "fork" &&
      options.start_method != "forkserver") {
    return absl::InvalidArgumentError(absl::StrCat("--start_method ", options.start_method,
                                                   ": expected spawn, fork or forkserver"));
  }
  options.master_addr = text["master_addr"];
  options.rdzv_backend = text["rdzv_backend"];
  options.rdzv_endpoint = text["rdzv_endpoint"];
  options.rdzv_id = text["rdzv_id"];
  if (options.rdzv_id.empty()) {
    return absl::InvalidArgumentError(
        "--rdzv_id is empty: expected the id every node of the job gives (or leave the flag out)");
  }
  options.role = text["role"];
  options.log_dir = text["log_dir"];
  options.local_addr = text["local_addr"];

  // As torchrun: without a backend or an endpoint, node 0 hosts the
  // rendezvous at --master_addr:--master_port (static). An endpoint alone
  // names the muster service.
  if (options.rdzv_backend.empty()) {
    options.rdzv_backend = options.standalone || !options.rdzv_endpoint.empty() ? "grpc" : "static";
  }
  if (options.rdzv_backend != "grpc" && options.rdzv_backend != "c10d" &&
      options.rdzv_backend != "static") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_backend ", options.rdzv_backend,
        ": unknown backend; expected grpc (the muster rendezvous service), c10d or static"));
  }
  if (options.rdzv_backend != "static" && !options.standalone && options.rdzv_endpoint.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv_endpoint is required with --rdzv_backend ", options.rdzv_backend,
                     " (or use --standalone)"));
  }
  // The servers an agent embeds (--standalone, static, c10d) serve
  // plaintext: a client speaking TLS to one fails its handshake with an
  // SSL error that names neither cause nor cure.
  const RdzvConf& conf = options.rdzv_conf;
  if ((options.standalone || options.rdzv_backend != "grpc") &&
      (!conf.tls_ca.empty() || !conf.tls_cert.empty() || !conf.tls_key.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_conf tls_ca, tls_cert, tls_key: the rendezvous that ",
        options.standalone ? std::string("--standalone")
                           : absl::StrCat("--rdzv_backend ", options.rdzv_backend),
        " runs inside an agent serves plaintext; for TLS, start the rendezvous service with "
        "--tls-cert and --tls-key and give every node --rdzv_backend grpc --rdzv_endpoint "
        "host:port"));
  }
  if (options.rdzv_backend == "static" && !options.standalone && !options.rdzv_endpoint.empty()) {
    // torchrun's static backend takes its master from the endpoint when
    // one is given.
    if (absl::Status status = MasterFromEndpoint(options.rdzv_endpoint, &options); !status.ok()) {
      return status;
    }
  }
  if (options.rdzv_backend == "static" && options.node_rank < 0 && options.max_nodes > 1) {
    return absl::InvalidArgumentError(
        "--node_rank is required with --rdzv_backend static, torchrun's default without "
        "--rdzv_endpoint; or give every node --rdzv_endpoint of a rendezvous service, or use "
        "--rdzv_backend c10d");
  }
  if (options.rdzv_backend == "c10d" && !options.standalone && options.max_nodes > 1 &&
      absl::EndsWith(options.rdzv_endpoint, ":0")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_endpoint ", options.rdzv_endpoint,
        ": port 0 (a free port picked here) is for one node; other nodes could not find it"));
  }

  for (auto [flag, field] :
       {std::pair{"redirects", &options.redirects}, std::pair{"tee", &options.tee}}) {
    absl::StatusOr<std::map<int, int>> parsed = ParseStdStreams(text[flag]);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", parsed.status().message()));
    }
    *field = *parsed;
  }
  for (absl::string_view item :
       absl::StrSplit(text["local_ranks_filter"], ',', absl::SkipWhitespace())) {
    int rank = 0;
    if (!absl::SimpleAtoi(item, &rank) || rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--local_ranks_filter ", text["local_ranks_filter"],
                       ": expected a comma-separated list of local ranks"));
    }
    options.local_ranks_filter.push_back(rank);
  }
  for (absl::string_view name :
       absl::StrSplit(text["signals_to_handle"], ',', absl::SkipWhitespace())) {
    absl::StatusOr<int> signal_number = ParseSignalName(std::string(name));
    if (!signal_number.ok()) return signal_number.status();
    options.signals_to_handle.push_back(*signal_number);
  }
  return options;
}

}  // namespace muster::launcher
