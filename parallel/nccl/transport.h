// Which transports NCCL chose, read from its own INFO log.
//
// NCCL has no API that names the transport of a connection; it prints one
// line per channel connection at INFO level ("Channel 00/0 : 0[0] -> 1[1]
// via P2P/CUMEM"). When the user has not set NCCL_DEBUG, rank 0 asks NCCL
// for its INIT log in a file of its own (NcclTransportLog), and after the
// first collective (connections are made lazily) summarizes it in one line.
// With NCCL_DEBUG, NCCL_DEBUG_SUBSYS or NCCL_DEBUG_FILE set, NCCL's log is
// the user's and all three are left alone (and no summary is printed).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace muster::parallel {

struct NcclTransports {
  // Connections per transport, with device indices dropped:
  // "P2P/CUMEM", "SHM", "NET/IB/GDRDMA", "NET/Socket".
  std::map<std::string, int> connections;
  std::string network;  // from "Using network IB"; "" if not logged
};

// Reads the lines of an NCCL INFO log. Lines of other kinds are skipped.
NcclTransports ParseNcclTransports(absl::string_view log);

// "P2P/CUMEM (16 connections), NET/IB/GDRDMA (8); network IB", or
// "no connections (a world of one)".
std::string DescribeNcclTransports(const NcclTransports& transports);

// Sets up NCCL's log for the summary: unless NCCL_DEBUG, NCCL_DEBUG_SUBSYS
// or NCCL_DEBUG_FILE is set, points
// NCCL_DEBUG (INFO), NCCL_DEBUG_SUBSYS (INIT) and NCCL_DEBUG_FILE at a file
// in `dir` and returns its path; std::nullopt when the user's settings
// stand. Call before NCCL is first used in this process.
std::optional<std::string> NcclTransportLog(const std::string& dir);

}  // namespace muster::parallel
