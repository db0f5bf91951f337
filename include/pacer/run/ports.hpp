// Port allocation for services started per rank: deterministic ranges, each port proven free by binding it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::run {

// How the port space is cut: each job gets a block of ranks_per_job ranges of
// per_rank ports; block = job mod (number of blocks that fit in [first, last]).
struct PortPlan {
  int first = 20000;
  int last = 59999;
  int per_rank = 16;
  int ranks_per_job = 8;
};

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

// [lo, hi] of a job's local rank: the same on every call, on every node.
Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope);

// The record of `pacer ports --json` (schema pacer.ports/1): whose ports,
// their range and the ports acquired in it.
nlohmann::json to_json(const PortScope& scope, const std::pair<int, int>& range, const std::vector<int>& ports);

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
