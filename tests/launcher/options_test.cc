#include "launcher/options.h"

#include <catch2/catch.hpp>
#include <csignal>

#include "absl/strings/match.h"

namespace muster::launcher {
namespace {

absl::StatusOr<LaunchOptions> Parse(std::vector<std::string> args,
                                    std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "launch");
  return ParseLaunchOptions(args, env);
}

TEST_CASE("torchrun's defaults hold when only a target is given") {
  auto options = Parse({"--standalone", "train.yaml"});
  REQUIRE(options.ok());
  CHECK(options->min_nodes == 1);
  CHECK(options->max_nodes == 1);
  CHECK(options->nproc_per_node == "1");
  CHECK(options->master_addr == "127.0.0.1");
  CHECK(options->master_port == 29500);
  CHECK(options->max_restarts == 0);
  CHECK(options->monitor_interval == absl::Milliseconds(100));
  CHECK(options->role == "default");
  CHECK(options->shutdown_timeout == absl::Seconds(30));
  CHECK(options->preempt_grace == absl::Seconds(30));
  CHECK(options->rdzv_conf.join_timeout == absl::Seconds(600));
  CHECK(options->rdzv_conf.last_call_timeout == absl::Seconds(30));
  CHECK(options->rdzv_conf.close_timeout == absl::Seconds(30));
  CHECK(options->signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(options->target_kind == TargetKind::kYamlConfig);
}

TEST_CASE("both spellings of a flag, and = or space") {
  auto underscored = Parse({"--nproc_per_node=4", "--rdzv_endpoint", "h:1", "x.py"});
  auto dashed = Parse({"--nproc-per-node", "4", "--rdzv-endpoint=h:1", "x.py"});
  REQUIRE(underscored.ok());
  REQUIRE(dashed.ok());
  CHECK(underscored->nproc_per_node == "4");
  CHECK(dashed->nproc_per_node == "4");
  CHECK(dashed->rdzv_endpoint == "h:1");
  CHECK(dashed->target_kind == TargetKind::kPythonScript);
}

TEST_CASE("--flag= is an empty value, never the next word") {
  // `--rdzv_id=$UNSET --nnodes=2` used to run a one-node job with the id
  // "--nnodes=2"; `--role= --nproc_per_node=2` lost the worker count.
  auto role = Parse({"--standalone", "--role=", "--nproc_per_node=2", "x.py", "--out=", "y"});
  REQUIRE(role.ok());
  CHECK(role->role.empty());
  CHECK(role->nproc_per_node == "2");
  CHECK(role->target == "x.py");
  CHECK(role->target_args == std::vector<std::string>{"--out=", "y"});  // as given
  auto conf = Parse({"--standalone", "--rdzv_conf=", "--log_dir=", "x.py"});
  REQUIRE(conf.ok());
  CHECK(conf->target == "x.py");
  auto id = Parse({"--rdzv_id=", "--nnodes=2", "x.py"});
  CHECK(absl::IsInvalidArgument(id.status()));
  CHECK(absl::StrContains(id.status().message(), "--rdzv_id is empty"));
  auto nproc = Parse({"--standalone", "--nproc_per_node=", "2", "x.py"});
  CHECK(absl::IsInvalidArgument(nproc.status()));
  CHECK(absl::IsInvalidArgument(Parse({"--standalone", "--max_restarts=", "x.py"}).status()));
  auto flag = Parse({"--standalone=", "x.py"});
  CHECK(absl::IsInvalidArgument(flag.status()));
  CHECK(!absl::StrContains(flag.status().message(), "\x01"));
}

TEST_CASE("--standalone is one node: --nnodes above 1 is refused, a range capped") {
  auto two = Parse({"--standalone", "--nnodes=2", "x.py"});
  CHECK(absl::IsInvalidArgument(two.status()));
  CHECK(absl::StrContains(two.status().message(), "--nnodes 2 with --standalone"));
  auto range = Parse({"--standalone", "--nnodes=1:3", "x.py"});
  REQUIRE(range.ok());
  CHECK(range->min_nodes == 1);
  CHECK(range->max_nodes == 1);
}

TEST_CASE("the rendezvous backend as torchrun picks it") {
  // Nothing given: static, node 0 hosting at master_addr:master_port.
  auto bare = Parse({"t.yaml"});
  REQUIRE(bare.ok());
  CHECK(bare->rdzv_backend == "static");
  CHECK(bare->master_addr == "127.0.0.1");
  CHECK(bare->master_port == 29500);
  // An endpoint alone: the muster service there.
  auto endpoint = Parse({"--rdzv_endpoint=rdzv.cluster", "t.yaml"});
  REQUIRE(endpoint.ok());
  CHECK(endpoint->rdzv_backend == "grpc");
  auto standalone = Parse({"--standalone", "t.yaml"});
  REQUIRE(standalone.ok());
  CHECK(standalone->rdzv_backend == "grpc");
  // static with an endpoint: the endpoint is the master.
  auto master = Parse({"--rdzv_backend=static", "--rdzv_endpoint=node0:1234", "--nnodes=2",
                       "--node_rank=1", "t.yaml"});
  REQUIRE(master.ok());
  CHECK(master->master_addr == "node0");
  CHECK(master->master_port == 1234);
  auto v6 = Parse({"--rdzv_backend=static", "--rdzv_endpoint=[::1]:99", "t.yaml"});
  REQUIRE(v6.ok());
  CHECK(v6->master_addr == "::1");
  CHECK(v6->master_port == 99);
  auto portless =
      Parse({"--rdzv_backend=static", "--rdzv_endpoint=node0", "--master_port=7", "t.yaml"});
  REQUIRE(portless.ok());
  CHECK(portless->master_addr == "node0");
  CHECK(portless->master_port == 7);
  // c10d, from the flags or torchrun's PET_ variables; is_host.
  auto c10d = Parse({"t.yaml"}, {{"PET_RDZV_BACKEND", "c10d"}, {"PET_RDZV_ENDPOINT", "h:5"}});
  REQUIRE(c10d.ok());
  CHECK(c10d->rdzv_backend == "c10d");
  CHECK(c10d->rdzv_endpoint == "h:5");
  CHECK_FALSE(c10d->rdzv_conf.is_host.has_value());
  auto guest =
      Parse({"--rdzv-backend=c10d", "--rdzv-endpoint=h:5", "--rdzv-conf=is_host=0", "t.yaml"});
  REQUIRE(guest.ok());
  CHECK(guest->rdzv_conf.is_host == std::optional<bool>(false));
  auto single = Parse({"--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "t.yaml"});
  REQUIRE(single.ok());
  // torchrun's TCPStore keys are accepted (and have nothing to set here).
  CHECK(Parse({"--rdzv-backend=c10d", "--rdzv-endpoint=h:5",
               "--rdzv-conf=read_timeout=120,use_libuv=0,join_timeout=900", "t.yaml"})
            .ok());
}

TEST_CASE("torchrun's --start_method and --run_path are accepted") {
  auto options = Parse({"--standalone", "--start-method=fork", "--run_path", "train.py", "--x"});
  REQUIRE(options.ok());
  CHECK(options->start_method == "fork");
  CHECK(options->run_path);
  CHECK(options->target == "train.py");
  CHECK(options->target_kind == TargetKind::kPythonScript);
  CHECK(options->target_args == std::vector<std::string>{"--x"});
}

TEST_CASE("PET_ variables are defaults that flags override") {
  std::map<std::string, std::string> env = {
      {"PET_NNODES", "2:4"}, {"PET_MAX_RESTARTS", "3"}, {"PET_RDZV_ENDPOINT", "h:1"}};
  auto from_env = Parse({"t.yaml"}, env);
  REQUIRE(from_env.ok());
  CHECK(from_env->min_nodes == 2);
  CHECK(from_env->max_nodes == 4);
  CHECK(from_env->max_restarts == 3);
  auto standalone = Parse({"t.yaml"}, {{"PET_STANDALONE", "1"}});
  REQUIRE(standalone.ok());
  CHECK(standalone->standalone);
  auto overridden = Parse({"--max_restarts", "5", "t.yaml"}, env);
  REQUIRE(overridden.ok());
  CHECK(overridden->max_restarts == 5);
}

TEST_CASE("arguments after the target pass through untouched") {
  auto options = Parse({"--standalone", "--no_python", "/bin/echo", "--nnodes", "7", "-x"});
  REQUIRE(options.ok());
  CHECK(options->target == "/bin/echo");
  CHECK(options->target_args == std::vector<std::string>{"--nnodes", "7", "-x"});
  CHECK(options->target_kind == TargetKind::kExecutable);
  CHECK(options->min_nodes == 1);
}

TEST_CASE("torchrun's command-line habits: a repeated flag, --, and any target run by python") {
  // Wrappers append overrides to a default command line: the last wins.
  auto repeated =
      Parse({"--nproc_per_node=1", "--nproc_per_node=2", "--standalone", "--standalone", "x.py"});
  REQUIRE(repeated.ok());
  CHECK(repeated->nproc_per_node == "2");
  // "--" ends the flags.
  auto dashes = Parse({"--standalone", "--", "x.py", "--", "a"});
  REQUIRE(dashes.ok());
  CHECK(dashes->target == "x.py");
  CHECK(dashes->target_args == std::vector<std::string>{"--", "a"});
  // A script without .py (or a zipapp, or a directory with __main__.py) is
  // still Python's; an executable file, or --no_python, runs as it is.
  for (const char* target : {"trainscript", "app.pyz", "/tmp"}) {
    auto python = Parse({"--standalone", target});
    REQUIRE(python.ok());
    CHECK(python->target_kind == TargetKind::kPythonScript);
  }
  auto program = Parse({"--standalone", "/bin/echo"});
  REQUIRE(program.ok());
  CHECK(program->target_kind == TargetKind::kExecutable);
  auto both = Parse({"--no_python", "-m", "pkg.train"});
  REQUIRE_FALSE(both.ok());
  CHECK(std::string(both.status().message()).find("--no_python and --module") != std::string::npos);
}

TEST_CASE("rdzv_conf keys") {
  auto options = Parse({"--standalone",
                        "--rdzv_conf=join_timeout=5,last_call_timeout=0.5,lease_ttl=2s,"
                        "token_file=/t,keep_alive_max_attempt=4",
                        "t.yaml"});
  REQUIRE(options.ok());
  CHECK(options->rdzv_conf.join_timeout == absl::Seconds(5));
  CHECK(options->rdzv_conf.last_call_timeout == absl::Milliseconds(500));
  CHECK(options->rdzv_conf.lease_ttl == absl::Seconds(2));
  CHECK(options->rdzv_conf.token_file == "/t");
  CHECK(options->rdzv_conf.keep_alive_max_attempt == 4);
  // torchrun's static backend calls it timeout.
  auto torchrun = Parse({"--standalone", "--rdzv_conf=timeout=900", "t.yaml"});
  REQUIRE(torchrun.ok());
  CHECK(torchrun->rdzv_conf.join_timeout == absl::Seconds(900));
}

TEST_CASE("torchrun's keep-alive settings set the lease and its renewals") {
  auto defaults = Parse({"--standalone", "t.yaml"});
  REQUIRE(defaults.ok());
  CHECK(defaults->rdzv_conf.lease_ttl == absl::Seconds(10));
  CHECK(defaults->rdzv_conf.keep_alive_interval == absl::Seconds(10) / 3);

  // Alone, as torchrun's: dead after interval x attempts.
  auto alone = Parse(
      {"--standalone", "--rdzv_conf=keep_alive_interval=2,keep_alive_max_attempt=4", "t.yaml"});
  REQUIRE(alone.ok());
  CHECK(alone->rdzv_conf.lease_ttl == absl::Seconds(8));
  CHECK(alone->rdzv_conf.keep_alive_interval == absl::Seconds(2));

  auto attempts =
      Parse({"--standalone", "--rdzv_conf=lease_ttl=6,keep_alive_max_attempt=6", "t.yaml"});
  REQUIRE(attempts.ok());
  CHECK(attempts->rdzv_conf.keep_alive_interval == absl::Seconds(1));

  auto both = Parse({"--standalone", "--rdzv_conf=lease_ttl=6,keep_alive_interval=0.5", "t.yaml"});
  REQUIRE(both.ok());
  CHECK(both->rdzv_conf.lease_ttl == absl::Seconds(6));
  CHECK(both->rdzv_conf.keep_alive_interval == absl::Milliseconds(500));

  auto lapses = Parse({"--standalone", "--rdzv_conf=lease_ttl=2,keep_alive_interval=3", "t.yaml"});
  CHECK(absl::IsInvalidArgument(lapses.status()));
  CHECK(lapses.status().message() ==
        "--rdzv_conf keep_alive_interval 3s is not shorter than lease_ttl 2s: the lease would "
        "lapse between renewals");
  auto zero = Parse({"--standalone", "--rdzv_conf=keep_alive_interval=0", "t.yaml"});
  CHECK(absl::IsInvalidArgument(zero.status()));
}

TEST_CASE("TLS settings for a rendezvous an agent embeds are refused, naming the way to TLS") {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--standalone", "--rdzv_conf=tls_ca=/ca.pem", "t.yaml"},
           {"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--rdzv_conf=tls_ca=/ca.pem",
            "t.yaml"},
           {"--nnodes=2", "--node_rank=0", "--rdzv_conf=tls_cert=/c.pem,tls_key=/k.pem",
            "t.yaml"}}) {
    auto options = Parse(args);
    INFO(args[0]);
    CHECK(absl::IsInvalidArgument(options.status()));
    CHECK(absl::StrContains(options.status().message(), "serves plaintext"));
    CHECK(absl::StrContains(options.status().message(), "--rdzv_backend grpc --rdzv_endpoint"));
  }
  auto service = Parse({"--rdzv_endpoint=rdzv:29400", "--rdzv_conf=tls_ca=/ca.pem", "t.yaml"});
  REQUIRE(service.ok());
  CHECK(service->rdzv_conf.tls_ca == "/ca.pem");
}

TEST_CASE("redirects, tee and the local rank filter") {
  auto options = Parse(
      {"--standalone", "-r", "3", "--tee", "0:1,2:3", "--local_ranks_filter", "0,2", "t.yaml"});
  REQUIRE(options.ok());
  CHECK(StreamsFor(options->redirects, 5) == 3);
  CHECK(StreamsFor(options->tee, 0) == 1);
  CHECK(StreamsFor(options->tee, 1) == 0);
  CHECK(StreamsFor(options->tee, 2) == 3);
  CHECK(options->local_ranks_filter == std::vector<int>{0, 2});
}

TEST_CASE("bad flags name the flag") {
  struct Case {
    std::vector<std::string> args;
    std::string mentions;
  };
  std::vector<Case> cases = {
      {{"--nnodes", "3:2", "--standalone", "t.yaml"}, "--nnodes 3:2"},
      {{"--nnodes", "0", "--standalone", "t.yaml"}, "--nnodes"},
      {{"--rdzv_backend", "etcd", "--rdzv_endpoint", "h", "t.yaml"}, "--rdzv_backend etcd"},
      {{"--standalone"}, "missing target"},
      {{"--rdzv_endpoint", "h"}, "missing target"},
      {{"--rdzv_backend", "grpc", "t.yaml"},
       "--rdzv_endpoint is required with --rdzv_backend grpc"},
      {{"--rdzv_backend", "c10d", "t.yaml"},
       "--rdzv_endpoint is required with --rdzv_backend c10d"},
      {{"--rdzv_backend=c10d", "--rdzv_endpoint=h:0", "--nnodes=2", "t.yaml"}, "port 0"},
      {{"--rdzv_backend=static", "--rdzv_endpoint=h:x", "t.yaml"}, "--rdzv_endpoint h:x"},
      {{"--nnodes=2", "t.yaml"}, "--node_rank is required with --rdzv_backend static"},
      {{"--standalone", "--rdzv_conf", "is_host=maybe", "t.yaml"}, "is_host=maybe"},
      {{"--standalone", "--rdzv_conf", "read_timeout=never", "t.yaml"}, "read_timeout"},
      {{"--standalone", "--rdzv_conf", "use_libuv=yes", "t.yaml"}, "use_libuv=yes"},
      {{"--standalone", "--start_method", "thread", "t.yaml"}, "--start_method thread"},
      {{"--standalone", "--nproc_per_node", "zero", "t.yaml"}, "--nproc_per_node zero"},
      {{"--standalone", "--rdzv_conf", "bogus=1", "t.yaml"}, "unknown key 'bogus'"},
      {{"--standalone", "--rdzv_conf", "join_timeout=soon", "t.yaml"}, "join_timeout"},
      {{"--standalone", "--tee", "7", "t.yaml"}, "--tee"},
      {{"--standalone", "--max_restarts", "-1", "t.yaml"}, "--max_restarts"},
      {{"--standalone", "--signals_to_handle", "SIGFOO", "t.yaml"}, "SIGFOO"},
      {{"--standalone", "--bogus", "t.yaml"}, "--bogus"},
      {{"--standalone", "--preempt_grace", "-1", "t.yaml"}, "--preempt_grace"},
  };
  for (const Case& c : cases) {
    auto options = Parse(c.args);
    INFO(c.mentions);
    REQUIRE_FALSE(options.ok());
    CHECK(options.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(options.status().message()).find(c.mentions) != std::string::npos);
  }
}

TEST_CASE("--preempt_grace takes seconds or a duration, and PET_PREEMPT_GRACE") {
  auto seconds = Parse({"--standalone", "--preempt_grace=45", "t.yaml"});
  REQUIRE(seconds.ok());
  CHECK(seconds->preempt_grace == absl::Seconds(45));
  auto dashed = Parse({"--standalone", "--preempt-grace", "1500ms", "t.yaml"});
  REQUIRE(dashed.ok());
  CHECK(dashed->preempt_grace == absl::Milliseconds(1500));
  auto from_env = Parse({"--standalone", "t.yaml"}, {{"PET_PREEMPT_GRACE", "7"}});
  REQUIRE(from_env.ok());
  CHECK(from_env->preempt_grace == absl::Seconds(7));
}

TEST_CASE("nproc_per_node resolution") {
  CHECK(*ResolveNprocPerNode("auto", 0, 6) == 6);
  CHECK(*ResolveNprocPerNode("auto", 8, 6) == 8);
  CHECK(*ResolveNprocPerNode("cpu", 8, 6) == 6);
  CHECK(*ResolveNprocPerNode("3", 8, 6) == 3);
  CHECK(ResolveNprocPerNode("gpu", 0, 6).status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("help is reported, not an error") {
  auto options = Parse({"--help"});
  REQUIRE(options.status().code() == absl::StatusCode::kCancelled);
  CHECK(std::string(options.status().message()).find("--nproc_per_node") != std::string::npos);
}

}  // namespace
}  // namespace muster::launcher
