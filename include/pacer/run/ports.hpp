// Port allocation for services started per rank: deterministic ranges, each port proven free by binding it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::run {

// How the port space is cut: the ports of [first, last] the kernel does not
// hand out on its own (outside its ephemeral range, or reserved) form
// contiguous segments; each job gets a block of ranks_per_job ranges of
// per_rank ports; block = job mod (number of blocks that fit in the segments).
// A block never straddles two segments.
struct PortPlan {
  int first = 20000;
  int last = 65535;
  int per_rank = 16;
  int ranks_per_job = 8;
  std::string root = "/";  // where /proc is read from (tests: a fake tree)
};

// What the kernel does with local ports: connect() and bind(0) pick from the
// ephemeral range (net.ipv4.ip_local_port_range, also used for IPv6) except
// the reserved ports (net.ipv4.ip_local_reserved_ports). A port handed out in
// the ephemeral range could be taken by any outgoing connection before the
// service binds it; a reserved one cannot.
struct LocalPorts {
  int ephemeral_first = 32768;  // Linux's default
  int ephemeral_last = 60999;
  std::vector<std::pair<int, int>> reserved;  // [lo, hi] ranges
  std::string source;  // the file read, or why the default was assumed
  bool usable(int port) const;  // not ephemeral, or reserved
};
// Reads root/proc/sys/net/ipv4/ip_local_port_range and ip_local_reserved_ports.
// A missing file (no /proc/sys) gives Linux's default range and no reserved
// ports, with `source` saying so; a malformed one is a kConfig error naming it.
Expected<LocalPorts> read_local_ports(const std::string& root = "/");
// The files' contents: "32768\t60999\n" and "8080,9000-9010\n" (may be empty).
Expected<std::pair<int, int>> parse_port_range(const std::string& text, const std::string& source);
Expected<std::vector<std::pair<int, int>>> parse_reserved_ports(const std::string& text, const std::string& source);

// Whose ports: the Slurm job and the local rank on this node.
struct PortScope {
  std::uint64_t job = 0;
  int local_rank = 0;
  std::string job_from;   // the variable it came from, or "none (bare: job 0)"
  std::string rank_from;  // the variable it came from, or "none (local rank 0)"
};

// SLURM_JOB_ID; SLURM_LOCALID, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID (the first one set). Errors name a variable that is not a
// number.
Expected<PortScope> port_scope_from_env();

// [lo, hi] of a job's local rank: the same on every call, on every node
// whose kernel has the same ephemeral range and reserved ports.
Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope);
Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope, const LocalPorts& local);

// The record of `pacer ports --json` (schema pacer.ports/1): whose ports,
// their range and the ports acquired in it.
nlohmann::json to_json(const PortScope& scope, const std::pair<int, int>& range, const std::vector<int>& ports,
                       const LocalPorts& local);

// Ports bound by this process, held (TCP, bound without SO_REUSEADDR on all
// addresses, so nobody else can bind them) until handed over or destroyed.
// Not thread safe; movable.
class PortLease {
 public:
  // The first `count` ports of the scope's range that bind. Errors: a bad
  // plan or rank (kUsage), or fewer than `count` free ports in the range
  // (kIo: the message names the range, job and rank).
  static Expected<PortLease> acquire(int count, const PortScope& scope, const PortPlan& plan = {});

  PortLease() = default;
  PortLease(PortLease&& other) noexcept;
  PortLease& operator=(PortLease&& other) noexcept;
  PortLease(const PortLease&) = delete;
  PortLease& operator=(const PortLease&) = delete;
  ~PortLease();  // releases every port still held

  const std::vector<int>& ports() const { return ports_; }
  // Hands a port over: stops holding it so the service can bind it now.
  void release(int port);
  void release_all();
  // Hands a port over as the bound socket itself (no window for anyone else):
  // the caller owns the returned descriptor; -1 when the port is not held.
  int take_fd(int port);

 private:
  std::vector<int> ports_;
  std::vector<int> fds_;  // -1 once handed over
};

// Binds a TCP socket to `port` on all addresses (no SO_REUSEADDR); the
// descriptor, or -errno.
int bind_port(int port);

}  // namespace pacer::run
