#include "launcher/endpoint.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "spdlog/spdlog.h"
#include "worker/config/config.h"

namespace muster::launcher {
namespace {

std::string RandomRunId() {
  std::random_device entropy;
  std::uniform_int_distribution<uint32_t> word;
  return absl::StrCat("run-", absl::Hex(word(entropy), absl::kZeroPad8),
                      absl::Hex(word(entropy), absl::kZeroPad8));
}

std::string HostOf(const std::string& endpoint) {
  if (!endpoint.empty() && endpoint[0] == '[') {
    size_t close = endpoint.find(']');
    return endpoint.substr(1, close == std::string::npos ? std::string::npos : close - 1);
  }
  return endpoint.substr(0, endpoint.rfind(':'));
}

// CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies), as
// the driver counts them; 0 without a driver. The driver library
// (libcuda.so.1) is on every GPU machine, unlike the runtime's unversioned
// libcudart.so, which comes only with a toolkit; the runtime is the
// fallback. dlopen keeps `launch` free of a link-time CUDA dependency.
int VisibleGpuCount() {
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    using Init = int (*)(unsigned int);
    using GetCount = int (*)(int*);
    auto init = reinterpret_cast<Init>(dlsym(driver, "cuInit"));
    auto get_count = reinterpret_cast<GetCount>(dlsym(driver, "cuDeviceGetCount"));
    int count = 0;
    bool counted =
        init != nullptr && get_count != nullptr && init(0) == 0 && get_count(&count) == 0;
    dlclose(driver);
    if (counted) return count;
  }
  void* runtime = dlopen("libcudart.so", RTLD_LAZY | RTLD_LOCAL);
  if (runtime == nullptr)
    runtime = dlopen("/usr/local/cuda/lib64/libcudart.so", RTLD_LAZY | RTLD_LOCAL);
  if (runtime == nullptr) return 0;
  using GetDeviceCount = int (*)(int*);
  auto get_count = reinterpret_cast<GetDeviceCount>(dlsym(runtime, "cudaGetDeviceCount"));
  int count = 0;
  if (get_count == nullptr || get_count(&count) != 0) count = 0;
  dlclose(runtime);
  return count;
}

// Whether `host` names this machine: a loopback address, or one that a
// socket here can bind (the kernel binds only its own addresses). As
// torchrun's c10d backend decides which agent hosts the store.
bool IsThisMachine(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool local = false;
  for (addrinfo* at = found; at != nullptr && !local; at = at->ai_next) {
    if (at->ai_family != AF_INET && at->ai_family != AF_INET6) continue;
    int fd = socket(at->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage address{};
    std::memcpy(&address, at->ai_addr, at->ai_addrlen);
    if (at->ai_family == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&address)->sin_port = 0;
    } else {
      reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = 0;
    }
    local = bind(fd, reinterpret_cast<sockaddr*>(&address), at->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return local;
}

// Whether a TCP listener could bind `port` on every interface now (gRPC
// would log a failed bind at length; this asks the kernel quietly first).
bool PortFree(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // let the server's own bind say
  int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));  // as gRPC's listener sets it
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return free;
}

// The port of a host[:port] or [v6][:port] endpoint; `fallback` if none.
int PortOf(const std::string& endpoint, int fallback) {
  const size_t close = endpoint.rfind(']');
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || (close != std::string::npos && colon < close) ||
      (close == std::string::npos && endpoint.find(':') != colon)) {
    return fallback;  // no port, or a bare IPv6 address
  }
  int port = fallback;
  return absl::SimpleAtoi(endpoint.substr(colon + 1), &port) ? port : fallback;
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

absl::StatusOr<std::string> MakeLogRoot(const LaunchOptions& options, const std::string& job_id) {
  std::error_code error;
  if (!options.log_dir.empty()) {
    std::string root = absl::StrCat(options.log_dir, "/", job_id);
    std::filesystem::create_directories(root, error);
    if (error) {
      return absl::InvalidArgumentError(
          absl::StrCat("--log_dir: cannot create ", root, ": ", error.message()));
    }
    return root;
  }
  // Error files need a home even without --log_dir, as in torchrun.
  std::string pattern =
      (std::filesystem::temp_directory_path() / absl::StrCat("muster_", job_id, "_XXXXXX"))
          .string();
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a log directory: ", strerror(errno)));
  }
  return pattern;
}

}  // namespace

void RemoveEmptyDirectories(const std::string& root) {
  std::error_code error;
  std::vector<std::string> directories = {root};
  for (auto it = std::filesystem::recursive_directory_iterator(root, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (it->is_directory(error) && !it->is_symlink(error)) directories.push_back(it->path());
  }
  // Deepest first: a directory is empty once its empty children are gone.
  // rmdir(2) removes only an empty directory, so nothing with a file in it
  // can go, whatever else writes there meanwhile.
  std::sort(directories.begin(), directories.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  for (const std::string& directory : directories) rmdir(directory.c_str());
}

absl::StatusOr<int> PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot find a free port: ", strerror(error)));
  }
  close(fd);
  return ntohs(address.sin_port);
}

std::string LocalAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  std::string result;
  int fd = socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) result = text;
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  return result;
}

absl::StatusOr<RoundWorld> RoundWorldFor(const LaunchOptions& options, int nproc) {
  RoundWorld world;
  world.min_nodes = options.min_nodes;
  world.max_nodes = options.max_nodes;
  // An embedded server is this node's alone: no other node can join it.
  const int reachable_max = options.standalone ? 1 : options.max_nodes;
  const std::string nodes_flag =
      options.standalone ? std::string("--standalone (one node)")
                         : absl::StrCat("--nnodes ", options.min_nodes, ":", options.max_nodes);
  uint32_t multiple = options.rdzv_conf.world_size_multiple;
  std::string source = absl::StrCat("--rdzv_conf world_size_multiple=", multiple);
  if (options.target_kind == TargetKind::kYamlConfig) {
    // Parsed without LoadConfig's file-system checks, and a config that
    // does not parse constrains nothing here: the worker reports it, with
    // its line, in the first round.
    std::ifstream file(options.target);
    std::stringstream text;
    text << file.rdbuf();
    absl::StatusOr<worker::TrainConfig> config =
        file ? worker::ParseConfig(text.str(), options.target, ".")
             : absl::NotFoundError(options.target);
    const int64_t needed = config.ok() ? worker::WorldSizeMultiple(config->parallel) : 1;
    const worker::ParallelConfig* parallel = config.ok() ? &config->parallel : nullptr;
    const std::string layout =
        parallel == nullptr
            ? ""
            : absl::StrCat(options.target, "'s parallel layout (dp_replicate ",
                           parallel->dp_replicate, " x dp_shard ", parallel->dp_shard, " x pp ",
                           parallel->pp, ", 0 is auto)");
    if (parallel != nullptr && worker::WorldSizeFixed(*parallel) && needed > 1) {
      // No auto degree: the world is the product, exactly; no multiple of
      // it will do, so every round takes the one node count that makes it.
      const int64_t nodes = needed / nproc;
      if (needed % nproc != 0 || nodes < options.min_nodes || nodes > reachable_max) {
        return absl::InvalidArgumentError(
            absl::StrCat(layout, " fixes the world at ", needed, " ranks, which ", nodes_flag,
                         " at --nproc_per_node ", nproc, " cannot make",
                         needed % nproc == 0 ? absl::StrCat(" (it takes ", nodes, " nodes)") : "",
                         "; or set a degree to 0 (auto) to let the world grow and shrink"));
      }
      world.min_nodes = world.max_nodes = static_cast<int>(nodes);
      if (options.min_nodes != options.max_nodes) {
        spdlog::info(
            "{} fixes the world at {} ranks: rounds take exactly {} nodes, and more wait "
            "as spares",
            layout, needed, nodes);
      }
      world.multiple = static_cast<uint32_t>(needed);
      return world;
    }
    if (needed > 1 && multiple == 0) {
      multiple = static_cast<uint32_t>(needed);
      source = layout;
    } else if (needed > 1 && multiple % needed != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, " would allow worlds that ", options.target, "'s parallel layout cannot use: ",
          "it needs multiples of ", needed, "; give a multiple of ", needed, " or leave it out"));
    }
  }
  if (multiple <= 1) return world;
  // nodes x nproc is a multiple of it exactly when nodes is a multiple of
  // `step`: the smallest such count from --nnodes's minimum up must fit.
  const uint64_t step = multiple / std::gcd(uint64_t{multiple}, static_cast<uint64_t>(nproc));
  const uint64_t first = (options.min_nodes + step - 1) / step * step;
  if (first > static_cast<uint64_t>(reachable_max)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, " needs a world that is a multiple of ", multiple, ", but with --nproc_per_node ",
        nproc, " no node count of ", nodes_flag, " makes one; the node counts that do are ",
        step == 1 ? "all" : absl::StrCat("the multiples of ", step)));
  }
  if (options.min_nodes != options.max_nodes) {
    spdlog::info(
        "rounds take only worlds that are a multiple of {} ({}): nodes beyond the largest such "
        "world wait as spares",
        multiple, source);
  }
  world.multiple = multiple;
  return world;
}

absl::StatusOr<RendezvousSetup> SetUpRendezvous(const LaunchOptions& options,
                                                rdzv::Cancellation* cancellation) {
  RendezvousSetup setup;
  const RdzvConf& conf = options.rdzv_conf;
  // Only gpu and auto need the count, and counting initialises the CUDA
  // driver (a fraction of a second): a plain number skips it. Both checks come
  // before the service is reached: a bad layout is told at once.
  const bool needs_gpus = options.nproc_per_node == "gpu" || options.nproc_per_node == "auto";
  absl::StatusOr<int> nproc =
      ResolveNprocPerNode(options.nproc_per_node, needs_gpus ? VisibleGpuCount() : 0,
                          static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))));
  if (!nproc.ok()) return nproc.status();
  absl::StatusOr<RoundWorld> world = RoundWorldFor(options, *nproc);
  if (!world.ok()) return world.status();
  std::string endpoint = options.rdzv_endpoint;
  setup.job_id = options.rdzv_id;

  if (options.standalone) {
    rdzv::ServerOptions server;
    server.listen_address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<rdzv::Server>> started = rdzv::Server::Start(server);
    if (!started.ok()) return started.status();
    setup.server = *std::move(started);
    endpoint = absl::StrCat("127.0.0.1:", setup.server->port());
    if (setup.job_id == "none") setup.job_id = RandomRunId();
  } else if (options.rdzv_backend == "c10d") {
    // torchrun's c10d: the agent on the endpoint's machine hosts the
    // rendezvous, here the muster service, and every agent, that one too,
    // reaches it as a client. A second agent on that machine finds the
    // port taken and is a client only. Port 0 (one node) picks a free one.
    const int port = PortOf(endpoint, rdzv::kDefaultRendezvousPort);
    const std::string host = HostOf(endpoint);
    const bool v6 = host.find(':') != std::string::npos;
    const bool hosts = conf.is_host.value_or(IsThisMachine(host));
    if (port == 0 && !hosts) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rdzv_endpoint ", endpoint,
                       ": port 0 picks a free port, which only an agent on ", host, " can do"));
    }
    if (hosts) {
      rdzv::ServerOptions server;
      server.listen_address = absl::StrCat(v6 ? "[::]" : "0.0.0.0", ":", port);
      server.token_file = conf.token_file;
      absl::StatusOr<std::unique_ptr<rdzv::Server>> started =
          port == 0 || PortFree(port)
              ? rdzv::Server::Start(server)
              : absl::UnavailableError(absl::StrCat("port ", port, " is in use"));
      if (started.ok()) {
        setup.server = *std::move(started);
        if (port == 0) {
          endpoint = absl::StrCat(v6 ? "[" + host + "]" : host, ":", setup.server->port());
        }
        spdlog::info("c10d: this agent hosts the rendezvous on port {}", setup.server->port());
      } else if (port == 0) {
        return started.status();
      } else {
        spdlog::info(
            "c10d: {}; joining the rendezvous there as a client (another agent on "
            "this machine hosts it)",
            std::string(started.status().message()));
      }
    }
    if (setup.job_id == "none" && port == 0) setup.job_id = RandomRunId();
  } else if (options.rdzv_backend == "static") {
    endpoint = absl::StrCat(options.master_addr, ":", options.master_port);
    if (options.node_rank <= 0) {
      rdzv::ServerOptions server;
      server.listen_address = absl::StrCat("0.0.0.0:", options.master_port);
      server.token_file = conf.token_file;
      absl::StatusOr<std::unique_ptr<rdzv::Server>> started = rdzv::Server::Start(server);
      if (!started.ok()) {
        return absl::UnavailableError(absl::StrCat(
            "static rendezvous on port ", options.master_port, ": ", started.status().message(),
            " (another job on this machine? give it --master_port, or use --standalone)"));
      }
      setup.server = *std::move(started);
    }
  }

  rdzv::ClientOptions client;
  client.endpoint = endpoint;
  client.token_file = conf.token_file;
  client.tls_ca_file = conf.tls_ca;
  client.tls_cert_file = conf.tls_cert;
  client.tls_key_file = conf.tls_key;
  client.job_secret_file = conf.job_secret_file;
  absl::StatusOr<std::unique_ptr<rdzv::Client>> connected = rdzv::Client::Connect(client);
  if (!connected.ok()) return connected.status();
  setup.client = *std::move(connected);

  // One cheap call proves the service is there and takes our credentials.
  // It waits (bounded) for a service still starting. A shared service
  // should be up: a wrong endpoint fails within 30 s. One that another
  // node's agent hosts (static, c10d) starts when that agent does, which
  // may be minutes later (an image pull, a staggered start): it is waited
  // for up to join_timeout, as torchrun's nodes wait for node 0's store.
  const bool hosted_elsewhere = setup.server == nullptr && (options.rdzv_backend == "static" ||
                                                            options.rdzv_backend == "c10d");
  rdzv::CallOptions call;
  call.timeout =
      hosted_elsewhere ? conf.join_timeout : std::min(conf.join_timeout, absl::Seconds(30));
  if (hosted_elsewhere) {
    spdlog::info(
        "connecting to the rendezvous service at {} (hosted by another node's agent: "
        "waiting up to {} for it)",
        endpoint, absl::FormatDuration(call.timeout));
  } else {
    spdlog::info("connecting to the rendezvous service at {}", endpoint);
  }
  rendezvous::v1::DescribeJobRequest probe;
  probe.set_job_id(setup.job_id);
  call.cancellation = cancellation;
  absl::Status reached = setup.client->DescribeJob(probe, call).status();
  if (!reached.ok() && !absl::IsNotFound(reached)) {
    // The client's message names a failed TLS handshake and its cause.
    return absl::Status(reached.code(), absl::StrCat("cannot use the rendezvous service at ",
                                                     endpoint, ": ", reached.message()));
  }

  setup.access.endpoint = endpoint;
  setup.access.token_file = conf.token_file;
  setup.access.tls_ca = conf.tls_ca;
  setup.access.tls_cert = conf.tls_cert;
  setup.access.tls_key = conf.tls_key;
  setup.access.job_secret_file = conf.job_secret_file;
  setup.hostname = Hostname();

  rendezvous::v1::JoinRequest& join = setup.join;
  join.set_job_id(setup.job_id);
  join.set_hostname(setup.hostname);
  std::string address = options.local_addr;
  if (address.empty()) address = LocalAddressToward(HostOf(endpoint));
  if (address.empty()) address = setup.hostname;
  join.set_address(address);
  join.set_nproc(static_cast<uint32_t>(*nproc));
  join.set_requested_rank(options.rdzv_backend == "static" ? std::max(options.node_rank, 0) : -1);
  rendezvous::v1::JobConfig* config = join.mutable_config();
  config->set_min_nodes(world->min_nodes);
  config->set_max_nodes(world->max_nodes);
  config->set_world_size_multiple(world->multiple);
  config->set_join_timeout_ms(absl::ToInt64Milliseconds(conf.join_timeout));
  config->set_last_call_timeout_ms(absl::ToInt64Milliseconds(conf.last_call_timeout));
  config->set_lease_ttl_ms(absl::ToInt64Milliseconds(conf.lease_ttl));
  config->set_max_restarts(options.max_restarts);

  absl::StatusOr<std::string> log_root = MakeLogRoot(options, setup.job_id);
  if (!log_root.ok()) return log_root.status();
  setup.log_root = *log_root;
  return setup;
}

}  // namespace muster::launcher
