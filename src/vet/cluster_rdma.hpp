// Internal: perftest's RDMA write bandwidth and latency between two node leaders.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/comm/timed.hpp"
#include "pacer/vet/cluster.hpp"

namespace pacer::vet {

// Both leaders of a ring pair call it, with `server` true on one of them.
// The client first says whether it can take part (RDMA ports, perftest), the
// server then starts one ib_write_bw and one ib_write_lat server per port
// pair and answers with its host and ports; the client runs the tests and
// returns the results (the server returns nothing). Every perftest process
// is killed at `deadline`. `tag` and `tag + 1` are used on `leaders`.
std::vector<RdmaResult> rdma_pair_test(comm::TimedComm& leaders, const ClusterOptions& o, int peer, bool server,
                                       const std::string& me, const std::string& peer_name, int tag, comm::Deadline deadline);

nlohmann::json rdma_to_json(const RdmaResult& r);
RdmaResult rdma_from_json(const nlohmann::json& j);

}  // namespace pacer::vet
