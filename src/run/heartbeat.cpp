// Progress heartbeats: the training side's two stores, the supervisor's reading, and the hang decision.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/run.hpp"
#include "pacer/run/ports.hpp"
#include "pacer/telemetry.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

// pacer.run.heartbeat/1: a 64-byte header, then kHeartbeatSlots slots of 64
// bytes (one cache line each, so ranks never share a line). Slot i belongs to
// local rank i. count == 0: nobody heartbeated there yet.
constexpr char kMagic[8] = {'P', 'A', 'C', 'E', 'R', 'H', 'B', '1'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeaderSize = 64;
constexpr std::size_t kSlotSize = 64;
constexpr std::size_t kFileSize = kHeaderSize + kHeartbeatSlots * kSlotSize;
constexpr std::uint64_t kNoStep = ~std::uint64_t{0};

struct Header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t slots;
  std::uint32_t slot_size;
  std::uint32_t reserved[11];
};
static_assert(sizeof(Header) == kHeaderSize);

struct Slot {
  std::int32_t pid;         // claimed with a compare-exchange from 0
  std::int32_t rank;
  std::int32_t local_rank;  // equals the slot's index; a check against corruption
  std::uint32_t reserved0;
  std::uint64_t count;      // written last: a reader that sees it sees the rest
  std::uint64_t step;       // kNoStep: none given
  std::uint64_t reserved[4];
};
static_assert(sizeof(Slot) == kSlotSize);

template <class T>
std::atomic_ref<T> at(T& v) {
  return std::atomic_ref<T>(v);
}

bool pid_alive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

// Alive and not a zombie: a rank that ended stays a zombie until its launcher
// reaps it, and must not count as a rank that stopped making progress.
bool pid_running(int pid) {
  if (!pid_alive(pid)) return false;
  auto stat = read_file(fmt::format("/proc/{}/stat", pid));
  if (!stat) return true;  // no /proc: trust kill()
  const auto paren = stat->rfind(')');  // the command name may hold spaces and parentheses
  return paren == std::string::npos || paren + 2 >= stat->size() || (*stat)[paren + 2] != 'Z';
}

// The training side's state: set once, by the first call.
struct Beat {
  std::once_flag once;
  Slot* slot = nullptr;
  Error error;
  bool failed = false;
};
Beat* g_beat = nullptr;

// A forked child shares the parent's mapping but is not a rank: it must not
// bump the parent's counter (that would hide the parent's hang).
void forget_in_child() {
  if (g_beat) g_beat->slot = nullptr;
}

Status claim(Beat& b) {
  const char* path = std::getenv(kHeartbeatFileEnv);
  if (!path || !*path) return {};
  const std::string where = fmt::format("${}={}", kHeartbeatFileEnv, path);
  const int fd = ::open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", where, std::strerror(errno))};
  struct stat st {};
  const bool ok_stat = ::fstat(fd, &st) == 0;
  if (!ok_stat || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() ||
      static_cast<std::uint64_t>(st.st_size) != kFileSize) {
    ::close(fd);
    return Error{ErrorKind::kConfig,
                 fmt::format("{}: not a heartbeat file of this user (a regular file of {} bytes expected, found {})",
                             where, kFileSize, ok_stat ? std::to_string(st.st_size) + " bytes" : "nothing")};
  }
  void* map = ::mmap(nullptr, kFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Error{ErrorKind::kIo, fmt::format("{}: mmap: {}", where, std::strerror(errno))};
  const auto* h = static_cast<const Header*>(map);
  if (std::memcmp(h->magic, kMagic, sizeof kMagic) != 0 || h->version != kVersion || h->slots != kHeartbeatSlots ||
      h->slot_size != kSlotSize) {
    ::munmap(map, kFileSize);
    return Error{ErrorKind::kConfig, fmt::format("{}: corrupt header (not pacer.run.heartbeat/1)", where)};
  }
  auto scope = port_scope_from_env();
  if (!scope) {
    ::munmap(map, kFileSize);
    return Error{ErrorKind::kUsage, "heartbeat: " + scope.error().message};
  }
  if (scope->local_rank < 0 || static_cast<std::uint32_t>(scope->local_rank) >= kHeartbeatSlots) {
    ::munmap(map, kFileSize);
    return Error{ErrorKind::kUsage, fmt::format("heartbeat: local rank {} (from {}) is not below {}", scope->local_rank,
                                                scope->rank_from, kHeartbeatSlots)};
  }
  Slot& s = reinterpret_cast<Slot*>(static_cast<unsigned char*>(map) + kHeaderSize)[scope->local_rank];
  const std::int32_t me = ::getpid();
  std::int32_t holder = 0;
  while (!at(s.pid).compare_exchange_strong(holder, me)) {
    // A holder that ended (a launcher's earlier worker) leaves its slot free.
    if (holder == me || pid_alive(holder)) break;
  }
  if (holder != 0 && holder != me && pid_alive(holder)) {
    ::munmap(map, kFileSize);
    return Error{ErrorKind::kUsage,
                 fmt::format("heartbeat: the slot of local rank {} (from {}) is held by pid {}: two processes with "
                             "one local rank",
                             scope->local_rank, scope->rank_from, holder)};
  }
  s.rank = telemetry::rank_from_env();
  s.local_rank = scope->local_rank;
  at(s.step).store(kNoStep, std::memory_order_relaxed);
  b.slot = &s;
  return {};
}

}  // namespace

Status heartbeat(std::optional<std::uint64_t> step) {
  static Beat beat;
  if (Slot* s = beat.slot) [[likely]] {
    // One writer per slot: a load and a store, not an atomic add. Threads of
    // one rank racing may lose a count; the counter still changes.
    at(s->step).store(step ? *step : kNoStep, std::memory_order_relaxed);
    at(s->count).store(at(s->count).load(std::memory_order_relaxed) + 1, std::memory_order_release);
    return {};
  }
  std::call_once(beat.once, [] {
    g_beat = &beat;
    ::pthread_atfork(nullptr, nullptr, forget_in_child);
    if (auto st = claim(beat); !st) {
      beat.error = st.error();
      beat.failed = true;
    }
  });
  if (beat.failed) return beat.error;
  if (beat.slot) return heartbeat(step);
  return {};
}

Expected<HeartbeatBoard> HeartbeatBoard::create(const std::string& path) {
  auto fd = open_fd(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (!fd) return fd.error();
  if (::ftruncate(fd->get(), kFileSize) != 0) return io_error("ftruncate", path, errno);
  void* map = ::mmap(nullptr, kFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0);
  if (map == MAP_FAILED) return io_error("mmap", path, errno);
  auto* h = static_cast<Header*>(map);
  std::memcpy(h->magic, kMagic, sizeof kMagic);
  h->version = kVersion;
  h->slots = kHeartbeatSlots;
  h->slot_size = kSlotSize;
  HeartbeatBoard b;
  b.path_ = path;
  b.map_ = map;
  return b;
}

HeartbeatBoard::HeartbeatBoard(HeartbeatBoard&& o) noexcept : path_(std::move(o.path_)), map_(o.map_) {
  o.map_ = nullptr;
}
HeartbeatBoard& HeartbeatBoard::operator=(HeartbeatBoard&& o) noexcept {
  std::swap(path_, o.path_);
  std::swap(map_, o.map_);
  return *this;
}
HeartbeatBoard::~HeartbeatBoard() {
  if (map_) ::munmap(map_, kFileSize);
}

std::vector<SlotReading> HeartbeatBoard::read() const {
  std::vector<SlotReading> out;
  if (!map_) return out;
  auto* slots = reinterpret_cast<Slot*>(static_cast<unsigned char*>(map_) + kHeaderSize);
  for (std::uint32_t i = 0; i < kHeartbeatSlots; ++i) {
    Slot& s = slots[i];
    const std::uint64_t count = at(s.count).load(std::memory_order_acquire);
    if (count == 0) continue;
    SlotReading r;
    r.local_rank = static_cast<int>(i);
    r.count = count;
    r.pid = at(s.pid).load(std::memory_order_relaxed);
    r.rank = at(s.rank).load(std::memory_order_relaxed);
    const std::uint64_t step = at(s.step).load(std::memory_order_relaxed);
    if (step != kNoStep) r.step = step;
    const int lr = at(s.local_rank).load(std::memory_order_relaxed);
    if (r.pid <= 0 || r.rank < 0 || lr != r.local_rank)
      r.problem = fmt::format("{}: slot {} is corrupt (pid {}, rank {}, local rank {}): ignored", path_, i, r.pid,
                              r.rank, lr);
    r.alive = r.problem.empty() && pid_running(r.pid);
    out.push_back(std::move(r));
  }
  return out;
}

std::optional<double> derived_hang_timeout(const std::vector<double>& intervals) {
  if (intervals.size() < static_cast<std::size_t>(kAutoHangAfter)) return std::nullopt;
  std::vector<double> v = intervals;
  const std::size_t k = std::min(v.size() - 1, static_cast<std::size_t>(std::ceil(0.99 * v.size())) - 1);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return std::max(5 * v[k], kAutoHangFloorS);
}

std::optional<double> HangWatch::timeout() const {
  if (fixed_) return *fixed_ > 0 ? fixed_ : std::nullopt;
  return derived_hang_timeout(intervals_);
}

std::optional<Hang> HangWatch::observe(const std::vector<SlotReading>& slots, double now) {
  constexpr std::size_t kKeep = 4096;
  std::vector<RankProgress> next;
  for (const auto& s : slots) {
    if (!s.problem.empty() || !s.alive) continue;
    auto old = std::find_if(ranks_.begin(), ranks_.end(),
                            [&](const RankProgress& r) { return r.local_rank == s.local_rank && r.pid == s.pid; });
    RankProgress r{s.local_rank, s.rank, s.pid, s.count, s.step, now};
    if (old != ranks_.end()) {
      r.last_change = old->last_change;
      if (s.count != old->count) {
        // The time per heartbeat over this poll interval; the poll period
        // bounds the resolution, which the 120 s floor makes irrelevant.
        const std::uint64_t beats = s.count > old->count ? s.count - old->count : 1;
        intervals_.push_back((now - old->last_change) / static_cast<double>(beats));
        if (intervals_.size() > kKeep) intervals_.erase(intervals_.begin(), intervals_.begin() + kKeep / 2);
        r.last_change = now;
      }
    }
    next.push_back(r);
  }
  ranks_ = std::move(next);
  const auto t = timeout();
  if (!t || ranks_.empty()) return std::nullopt;
  auto first = std::min_element(ranks_.begin(), ranks_.end(),
                                [](const RankProgress& a, const RankProgress& b) { return a.last_change < b.last_change; });
  const double idle = now - first->last_change;
  if (idle < *t) return std::nullopt;
  Hang h;
  h.first = *first;
  h.idle_s = idle;
  h.timeout_s = *t;
  h.all_stalled = std::all_of(ranks_.begin(), ranks_.end(),
                              [&](const RankProgress& r) { return now - r.last_change >= *t; });
  h.ranks = ranks_;
  return h;
}

}  // namespace pacer::run
