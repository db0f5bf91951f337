// Per-job, per-rank port ranges with every port proven free by binding it.
#include "pacer/run/ports.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace pacer::run {
namespace {

Expected<std::uint64_t> env_number(const char* name, bool* found) {
  const char* v = std::getenv(name);
  *found = v && *v;
  if (!*found) return std::uint64_t{0};
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (errno || !end || *end != '\0' || v[0] == '-')
    return Error{ErrorKind::kUsage, fmt::format("${}='{}' is not a number", name, v)};
  return static_cast<std::uint64_t>(n);
}

}  // namespace

Expected<PortScope> port_scope_from_env() {
  PortScope s;
  bool found = false;
  auto job = env_number("SLURM_JOB_ID", &found);
  if (!job) return job.error();
  s.job = *job;
  s.job_from = found ? "SLURM_JOB_ID" : "none (bare: job 0)";
  s.rank_from = "none (local rank 0)";
  for (const char* name : {"SLURM_LOCALID", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}) {
    auto r = env_number(name, &found);
    if (!r) return r.error();
    if (found) {
      s.local_rank = static_cast<int>(*r);
      s.rank_from = name;
      break;
    }
  }
  return s;
}

Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope) {
  if (plan.first < 1 || plan.last > 65535 || plan.first > plan.last || plan.per_rank < 1 || plan.ranks_per_job < 1)
    return Error{ErrorKind::kUsage, fmt::format("port plan {}-{}, {} per rank, {} ranks per job: not a valid plan",
                                                plan.first, plan.last, plan.per_rank, plan.ranks_per_job)};
  const long block = static_cast<long>(plan.per_rank) * plan.ranks_per_job;
  const long blocks = (static_cast<long>(plan.last) - plan.first + 1) / block;
  if (blocks < 1)
    return Error{ErrorKind::kUsage, fmt::format("ports {}-{} cannot hold one job's block of {} ports", plan.first,
                                                plan.last, block)};
  if (scope.local_rank < 0 || scope.local_rank >= plan.ranks_per_job)
    return Error{ErrorKind::kUsage, fmt::format("local rank {} (from {}) is outside the {} ranks per job of the plan",
                                                scope.local_rank, scope.rank_from, plan.ranks_per_job)};
  const long lo = plan.first + static_cast<long>(scope.job % static_cast<std::uint64_t>(blocks)) * block +
                  static_cast<long>(scope.local_rank) * plan.per_rank;
  return std::pair<int, int>{static_cast<int>(lo), static_cast<int>(lo + plan.per_rank - 1)};
}

int bind_port(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

Expected<PortLease> PortLease::acquire(int count, const PortScope& scope, const PortPlan& plan) {
  if (count < 1) return Error{ErrorKind::kUsage, fmt::format("port count {}: at least 1", count)};
  auto range = port_range(plan, scope);
  if (!range) return range.error();
  const auto [lo, hi] = *range;
  if (count > hi - lo + 1)
    return Error{ErrorKind::kUsage, fmt::format("{} ports wanted but a rank's range holds {} (ports {}-{})", count,
                                                hi - lo + 1, lo, hi)};
  PortLease lease;
  std::vector<int> busy;
  for (int p = lo; p <= hi && static_cast<int>(lease.ports_.size()) < count; ++p) {
    const int fd = bind_port(p);
    if (fd < 0) {
      if (fd != -EADDRINUSE && fd != -EACCES)
        return Error{ErrorKind::kIo, fmt::format("port {}: bind: {}", p, std::strerror(-fd))};
      busy.push_back(p);
      continue;
    }
    lease.ports_.push_back(p);
    lease.fds_.push_back(fd);
  }
  if (static_cast<int>(lease.ports_.size()) < count) {
    std::string list;
    for (int p : busy) list += (list.empty() ? "" : ",") + std::to_string(p);
    return Error{ErrorKind::kIo,
                 fmt::format("port range {}-{} (job {}, local rank {}) exhausted: {} wanted, {} free; in use: {}", lo, hi,
                             scope.job, scope.local_rank, count, lease.ports_.size(), list)};
  }
  return lease;
}

PortLease::PortLease(PortLease&& other) noexcept : ports_(std::move(other.ports_)), fds_(std::move(other.fds_)) {
  other.ports_.clear();
  other.fds_.clear();
}

PortLease& PortLease::operator=(PortLease&& other) noexcept {
  if (this != &other) {
    release_all();
    ports_ = std::move(other.ports_);
    fds_ = std::move(other.fds_);
    other.ports_.clear();
    other.fds_.clear();
  }
  return *this;
}

PortLease::~PortLease() { release_all(); }

void PortLease::release(int port) {
  for (std::size_t i = 0; i < ports_.size(); ++i)
    if (ports_[i] == port && fds_[i] >= 0) {
      close(fds_[i]);
      fds_[i] = -1;
    }
}

void PortLease::release_all() {
  for (auto& fd : fds_)
    if (fd >= 0) {
      close(fd);
      fd = -1;
    }
}

int PortLease::take_fd(int port) {
  for (std::size_t i = 0; i < ports_.size(); ++i)
    if (ports_[i] == port && fds_[i] >= 0) {
      const int fd = fds_[i];
      fds_[i] = -1;
      return fd;
    }
  return -1;
}

}  // namespace pacer::run
