// The NCCL transport summary, on log lines as NCCL 2.2x prints them
// (one node with P2P and SHM, two nodes over InfiniBand, sockets).
#include "parallel/nccl/transport.h"

#include <catch2/catch.hpp>
#include <cstdlib>

namespace muster::parallel {
namespace {

TEST_CASE("transports are counted per kind, device numbers dropped") {
  const char* log =
      "gpu-06:4015539:4015652 [0] NCCL INFO NCCL_IB_GID_INDEX set by environment to 3.\n"
      "gpu-06:4015539:4015652 [0] NCCL INFO Using network IB\n"
      "gpu-06:4015539:4015652 [0] NCCL INFO Channel 07/0 : 0[0] -> 2[0] [receive] via "
      "NET/IB/3/GDRDMA\n"
      "gpu-06:4015540:4015653 [1] NCCL INFO Channel 00/0 : 1[1] -> 3[1] [receive] via "
      "NET/IB/2/GDRDMA\n"
      "gpu-06:4015540:4015653 [1] NCCL INFO Channel 01/0 : 3[1] -> 1[1] [send] via "
      "NET/IB/2/GDRDMA\n"
      "gpu-06:4015540:4015653 [1] NCCL INFO Channel 00/0 : 3[1] -> 2[0] via P2P/CUMEM\n"
      "gpu-05:1789225:1789736 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/CUMEM\n"
      "gpu-05:1789225:1789736 [1] NCCL INFO Channel 03/0 : 1[1] -> 0[0] via P2P/CUMEM\n"
      "gpu-05:1789225:1789736 [1] NCCL INFO Channel 04/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
      "gpu-05:1789225:1789736 [1] NCCL INFO Connected all rings\n"
      "gpu-05:1789225:1789736 [1] NCCL WARN Channel 05/0 : 1[1] -> 0[0] via nothing\n";
  NcclTransports transports = ParseNcclTransports(log);
  CHECK(transports.network == "IB");
  CHECK(transports.connections == std::map<std::string, int>{{"NET/IB/GDRDMA", 3},
                                                             {"P2P/CUMEM", 3},
                                                             {"SHM/direct/direct", 1}});
  CHECK(DescribeNcclTransports(transports) ==
        "NET/IB/GDRDMA (3 connections), P2P/CUMEM (3), SHM/direct/direct (1); network IB");
}

TEST_CASE("sockets, a world of one, and text that is not NCCL's") {
  NcclTransports sockets = ParseNcclTransports(
      "h:1:2 [0] NCCL INFO Using network Socket\n"
      "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n");
  CHECK(DescribeNcclTransports(sockets) == "NET/Socket (1 connection); network Socket");
  CHECK(DescribeNcclTransports(ParseNcclTransports("h:1:2 [0] NCCL INFO Init COMPLETE\n")) ==
        "no connections (a world of one)");
  CHECK(ParseNcclTransports("Channel 00 -> via\n\n -> via P2P\x01").connections.empty());
}

TEST_CASE("the log is asked for only when the user has set none of NCCL's log settings") {
  unsetenv("NCCL_DEBUG");
  unsetenv("NCCL_DEBUG_SUBSYS");
  unsetenv("NCCL_DEBUG_FILE");
  auto path = NcclTransportLog("/tmp");
  REQUIRE(path.has_value());
  CHECK(std::string(std::getenv("NCCL_DEBUG")) == "INFO");
  CHECK(std::string(std::getenv("NCCL_DEBUG_SUBSYS")) == "INIT");
  CHECK(std::string(std::getenv("NCCL_DEBUG_FILE")) == *path);

  setenv("NCCL_DEBUG", "WARN", 1);
  unsetenv("NCCL_DEBUG_FILE");
  CHECK_FALSE(NcclTransportLog("/tmp").has_value());
  CHECK(std::string(std::getenv("NCCL_DEBUG")) == "WARN");
  CHECK(std::getenv("NCCL_DEBUG_FILE") == nullptr);

  // NCCL_DEBUG unset, but the user's subsystems or file: left as they are.
  unsetenv("NCCL_DEBUG");
  setenv("NCCL_DEBUG_SUBSYS", "COLL", 1);
  CHECK_FALSE(NcclTransportLog("/tmp").has_value());
  CHECK(std::getenv("NCCL_DEBUG") == nullptr);
  CHECK(std::string(std::getenv("NCCL_DEBUG_SUBSYS")) == "COLL");
  unsetenv("NCCL_DEBUG_SUBSYS");
  setenv("NCCL_DEBUG_FILE", "/var/log/nccl.%h.%p", 1);
  CHECK_FALSE(NcclTransportLog("/tmp").has_value());
  CHECK(std::getenv("NCCL_DEBUG") == nullptr);
  CHECK(std::string(std::getenv("NCCL_DEBUG_FILE")) == "/var/log/nccl.%h.%p");
  unsetenv("NCCL_DEBUG_FILE");
}

}  // namespace
}  // namespace muster::parallel
