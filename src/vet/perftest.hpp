// Internal: Debian's perftest (ib_write_bw, ib_write_lat) between two nodes, and the parsers of its reports.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::vet {

// The "BW average[Gb/sec]" of the last row of an ib_*_bw report (the largest
// message size), in Gb/s. Reports in MB/sec (no --report_gbits) are refused:
// which megabyte perftest means differs between its versions.
Expected<double> parse_perftest_bw(std::string_view report);
// The median round trip halved, "t_typical[usec]", of the last row of an
// ib_*_lat report, in microseconds; t_avg where a version prints no t_typical.
Expected<double> parse_perftest_lat(std::string_view report);

// One RDMA device and port of this node that a test can use (state ACTIVE).
struct RdmaPort {
  std::string device;
  int port = 1;
};
std::vector<RdmaPort> active_rdma_ports(const std::string& root);
// Why perftest cannot run here ("" when it can): no ib_write_bw on PATH.
std::string perftest_missing();
// True when GPUDirect RDMA can be used: the nvidia_peermem module is loaded
// (ROOT/sys/module/nvidia_peermem) and this perftest was built with CUDA.
bool gpudirect_available(const std::string& root);

struct PerftestArgs {
  RdmaPort port;
  int tcp_port = 18515;          // perftest's out-of-band connection
  std::optional<int> cuda_device;  // --use_cuda=N: buffers in that GPU's memory
  double duration_s = 2;
};
// The command lines: the server gets no host, the client the server's.
std::vector<std::string> perftest_bw_argv(const PerftestArgs& a, const std::string& server_host);
std::vector<std::string> perftest_lat_argv(const PerftestArgs& a, const std::string& server_host);

}  // namespace pacer::vet
