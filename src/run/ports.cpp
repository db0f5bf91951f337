// Per-job, per-rank port ranges with every port proven free by binding it.
#include "pacer/run/ports.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <tuple>

#include "pacer/core/atomic_file.hpp"

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

bool LocalPorts::usable(int port) const {
  if (port < ephemeral_first || port > ephemeral_last) return true;
  for (const auto& [lo, hi] : reserved)
    if (port >= lo && port <= hi) return true;
  return false;
}

namespace {

// One port number of a /proc file: digits only, at most 65535.
Expected<int> port_number(const std::string& text, std::size_t& i, const std::string& source) {
  const std::size_t start = i;
  long v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    v = v * 10 + (text[i] - '0');
    if (v > 65535) break;
    ++i;
  }
  if (i == start || v > 65535)
    return Error{ErrorKind::kConfig, fmt::format("{}: '{}' is not a port number (0-65535)", source,
                                                 text.substr(start, std::min<std::size_t>(16, text.size() - start)))};
  return static_cast<int>(v);
}

bool blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

}  // namespace

Expected<std::pair<int, int>> parse_port_range(const std::string& text, const std::string& source) {
  std::size_t i = 0;
  while (i < text.size() && blank(text[i])) ++i;
  auto lo = port_number(text, i, source);
  if (!lo) return lo.error();
  const std::size_t gap = i;
  while (i < text.size() && blank(text[i])) ++i;
  if (i == gap) return Error{ErrorKind::kConfig, fmt::format("{}: expected two port numbers (\"32768 60999\")", source)};
  auto hi = port_number(text, i, source);
  if (!hi) return hi.error();
  while (i < text.size() && blank(text[i])) ++i;
  if (i != text.size() || *lo < 1 || *lo > *hi)
    return Error{ErrorKind::kConfig, fmt::format("{}: expected two port numbers, low then high (\"32768 60999\")", source)};
  return std::pair<int, int>{*lo, *hi};
}

Expected<std::vector<std::pair<int, int>>> parse_reserved_ports(const std::string& text, const std::string& source) {
  std::vector<std::pair<int, int>> out;
  std::size_t end = text.size();
  while (end > 0 && blank(text[end - 1])) --end;
  const std::string list = text.substr(0, end);
  std::size_t i = 0;
  while (i < list.size()) {
    auto lo = port_number(list, i, source);
    if (!lo) return lo.error();
    int hi = *lo;
    if (i < list.size() && list[i] == '-') {
      ++i;
      auto h = port_number(list, i, source);
      if (!h) return h.error();
      hi = *h;
    }
    if (hi < *lo) return Error{ErrorKind::kConfig, fmt::format("{}: range {}-{} ends below its start", source, *lo, hi)};
    out.emplace_back(*lo, hi);
    if (i == list.size()) break;
    if (list[i] != ',') return Error{ErrorKind::kConfig, fmt::format("{}: expected ',' after {} at byte {}", source, hi, i)};
    ++i;
    if (i == list.size()) return Error{ErrorKind::kConfig, fmt::format("{}: list ends with ','", source)};
  }
  return out;
}

Expected<LocalPorts> read_local_ports(const std::string& root) {
  LocalPorts l;
  const std::string dir = (std::filesystem::path(root) / "proc/sys/net/ipv4").string();
  const std::string range_file = dir + "/ip_local_port_range";
  auto range_text = read_file(range_file);
  if (!range_text) {
    l.source = fmt::format("Linux's default {}-{} ({} unreadable)", l.ephemeral_first, l.ephemeral_last, range_file);
    return l;
  }
  auto range = parse_port_range(*range_text, range_file);
  if (!range) return range.error();
  std::tie(l.ephemeral_first, l.ephemeral_last) = *range;
  l.source = range_file;
  const std::string reserved_file = dir + "/ip_local_reserved_ports";
  if (auto text = read_file(reserved_file)) {
    auto reserved = parse_reserved_ports(*text, reserved_file);
    if (!reserved) return reserved.error();
    l.reserved = std::move(*reserved);
  }
  return l;
}

Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope) {
  auto local = read_local_ports(plan.root);
  if (!local) return local.error();
  return port_range(plan, scope, *local);
}

Expected<std::pair<int, int>> port_range(const PortPlan& plan, const PortScope& scope, const LocalPorts& local) {
  if (plan.first < 1 || plan.last > 65535 || plan.first > plan.last || plan.per_rank < 1 || plan.ranks_per_job < 1 ||
      plan.per_rank > 65535 || plan.ranks_per_job > 65535)
    return Error{ErrorKind::kUsage, fmt::format("port plan {}-{}, {} per rank, {} ranks per job: not a valid plan",
                                                plan.first, plan.last, plan.per_rank, plan.ranks_per_job)};
  if (scope.local_rank < 0 || scope.local_rank >= plan.ranks_per_job)
    return Error{ErrorKind::kUsage, fmt::format("local rank {} (from {}) is outside the {} ranks per job of the plan",
                                                scope.local_rank, scope.rank_from, plan.ranks_per_job)};
  const long block = static_cast<long>(plan.per_rank) * plan.ranks_per_job;
  // Usable ports of the plan as contiguous segments, and how many blocks each holds.
  std::vector<std::pair<long, long>> segments;  // first port, blocks
  long blocks = 0;
  for (long p = plan.first; p <= plan.last;) {
    if (!local.usable(static_cast<int>(p))) {
      ++p;
      continue;
    }
    long q = p;
    while (q + 1 <= plan.last && local.usable(static_cast<int>(q + 1))) ++q;
    if (const long n = (q - p + 1) / block; n > 0) {
      segments.emplace_back(p, n);
      blocks += n;
    }
    p = q + 1;
  }
  if (blocks < 1)
    return Error{ErrorKind::kUsage,
                 fmt::format("ports {}-{} outside the kernel's ephemeral range {}-{} (from {}) cannot hold one job's "
                             "block of {} ports: move --first/--last below or above it, or reserve ports with "
                             "net.ipv4.ip_local_reserved_ports",
                             plan.first, plan.last, local.ephemeral_first, local.ephemeral_last, local.source, block)};
  long k = static_cast<long>(scope.job % static_cast<std::uint64_t>(blocks));
  std::size_t s = 0;
  while (k >= segments[s].second) k -= segments[s++].second;
  const long lo = segments[s].first + k * block + static_cast<long>(scope.local_rank) * plan.per_rank;
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
