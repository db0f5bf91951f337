// Storage probes: free space, sequential throughput past the page cache, small-file metadata rate.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "pacer/core/units.hpp"
#include "pacer/core/posix_io.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct FsSpace {
  double free = 0;   // bytes available to unprivileged users
  double total = 0;
};

bool fs_space(const std::string& path, FsSpace& out) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return false;
  out.free = static_cast<double>(s.f_bavail) * static_cast<double>(s.f_frsize);
  out.total = static_cast<double>(s.f_blocks) * static_cast<double>(s.f_frsize);
  return true;
}

std::vector<Measurement> run_free(const ProbeContext& ctx) {
  std::vector<Measurement> out;
  for (const auto& t : ctx.storage) {
    FsSpace sp;
    // A read-only path still has a free-space figure; a missing one has none.
    if (!t.error.empty() && t.error.rfind("not writable", 0) != 0) {
      out.push_back(not_measured("storage.free", CheckStatus::kFail, t.error, t.path));
    } else if (!fs_space(t.path, sp)) {
      out.push_back(not_measured("storage.free", CheckStatus::kFail, fmt::format("statvfs: {}", std::strerror(errno)), t.path));
    } else {
      out.push_back(measured("storage.free", sp.free / 1073741824.0,
                             fmt::format("{:.0f}% of {} used", sp.total > 0 ? 100.0 * (1 - sp.free / sp.total) : 0.0,
                                         format_bytes(sp.total)), t.path));
    }
  }
  return out;
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// Fills a buffer with incompressible bytes so that compressing or
// deduplicating filesystems cannot flatter the figure.
void fill_random(unsigned char* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed | 1;
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

// Writes `size` bytes in `block`-sized pieces with O_DIRECT where the
// filesystem has it (else buffered, with fsync inside the timing and the cache
// dropped before reading), then reads them back and checks each block's tag.
void throughput(const ProbeContext& ctx, const StorageTarget& t, std::vector<Measurement>& out) {
  auto fail_both = [&](CheckStatus s, const std::string& why) {
    if (ctx.wants("storage.write")) out.push_back(not_measured("storage.write", s, why, t.path));
    if (ctx.wants("storage.read")) out.push_back(not_measured("storage.read", s, why, t.path));
  };
  if (!t.error.empty()) return fail_both(CheckStatus::kFail, t.error);
  const std::size_t block = std::max<std::size_t>(ctx.bytes("block") / 4096 * 4096, 4096);
  const std::size_t size = std::max<std::size_t>(ctx.bytes("size") / block * block, block);
  FsSpace sp;
  if (!fs_space(t.scratch, sp)) return fail_both(CheckStatus::kFail, fmt::format("statvfs: {}", std::strerror(errno)));
  const double reserve = std::max(static_cast<double>(ctx.bytes("reserve")), 0.05 * sp.total);
  if (sp.free < static_cast<double>(size) + reserve)
    return fail_both(CheckStatus::kFail, fmt::format("not tested: {} free, writing {} would leave less than the reserve of {}",
                                                     format_bytes(sp.free), format_bytes(double(size)), format_bytes(reserve)));
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, block) != 0) return fail_both(CheckStatus::kError, "cannot allocate the I/O buffer");
  std::unique_ptr<unsigned char, AlignedFree> buf(static_cast<unsigned char*>(raw));
  fill_random(buf.get(), block, 0x2545F4914F6CDD1DULL);

  const std::string file = t.scratch + "/sequential.dat";
  bool direct = true;
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd < 0 && errno == EINVAL) {
    direct = false;
    fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  }
  if (fd < 0) return fail_both(CheckStatus::kFail, fmt::format("cannot create {}: {}", file, std::strerror(errno)));
  const std::size_t blocks = size / block;
  auto t0 = Clock::now();
  for (std::size_t i = 0; i < blocks; ++i) {
    if (cancelled()) {
      ::close(fd);
      return;
    }
    std::uint64_t tag = i;
    std::memcpy(buf.get(), &tag, 8);  // every block differs, and reads can be checked
    if (Status w = write_full(fd, buf.get(), block, file); !w) {
      ::close(fd);
      return fail_both(CheckStatus::kFail, fmt::format("after {}: {}", format_bytes(double(i * block)), w.error().message));
    }
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return fail_both(CheckStatus::kFail, fmt::format("fsync failed: {}", std::strerror(err)));
  }
  const double wsec = since(t0);
  if (!direct) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  const std::string how = direct ? "O_DIRECT" : "buffered + fsync, cache dropped before reading (no O_DIRECT here)";
  if (ctx.wants("storage.write"))
    out.push_back(measured("storage.write", static_cast<double>(size) / wsec / 1e6,
                           fmt::format("{} in {} blocks, {}", format_bytes(double(size)), format_bytes(double(block)), how), t.path));
  if (!ctx.wants("storage.read")) return;

  fd = ::open(file.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
  if (fd < 0) {
    out.push_back(not_measured("storage.read", CheckStatus::kFail, fmt::format("cannot open {}: {}", file, std::strerror(errno)), t.path));
    return;
  }
  if (!direct) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  std::size_t mismatched = 0;
  t0 = Clock::now();
  for (std::size_t i = 0; i < blocks && !cancelled(); ++i) {
    auto got = read_full(fd, buf.get(), block, file);
    if (!got || *got < block) {
      ::close(fd);
      out.push_back(not_measured("storage.read", CheckStatus::kFail,
                                 got ? fmt::format("{}: read failed: short read", file) : got.error().message, t.path));
      return;
    }
    std::uint64_t tag = 0;
    std::memcpy(&tag, buf.get(), 8);
    if (tag != i) ++mismatched;
  }
  const double rsec = since(t0);
  ::close(fd);
  ::unlink(file.c_str());
  Measurement m = measured("storage.read", static_cast<double>(size) / rsec / 1e6,
                           fmt::format("{} in {} blocks, {}", format_bytes(double(size)), format_bytes(double(block)), how), t.path);
  if (mismatched) {
    m.status = CheckStatus::kFail;
    m.reason = fmt::format("{} of {} blocks read back different data than was written", mismatched, blocks);
  }
  out.push_back(m);
}

std::vector<Measurement> run_throughput(const ProbeContext& ctx) {
  std::vector<Measurement> out;
  for (const auto& t : ctx.storage) {
    if (cancelled()) break;
    throughput(ctx, t, out);
  }
  return out;
}

// The small-files problem: create, stat and unlink many empty files, as a
// data loader reading millions of samples or a checkpoint writing one file
// per tensor does.
std::vector<Measurement> run_metadata(const ProbeContext& ctx) {
  std::vector<Measurement> out;
  const long long files = std::max<long long>(ctx.integer("files"), 1);
  for (const auto& t : ctx.storage) {
    if (cancelled()) break;
    if (!t.error.empty()) {
      out.push_back(not_measured("storage.metadata", CheckStatus::kFail, t.error, t.path));
      continue;
    }
    std::vector<std::string> names;
    names.reserve(static_cast<std::size_t>(files));
    for (long long i = 0; i < files; ++i) names.push_back(fmt::format("{}/f{:07d}", t.scratch, i));
    std::string error;
    auto t0 = Clock::now();
    for (const auto& n : names) {
      const int fd = ::open(n.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
      if (fd < 0) {
        error = fmt::format("cannot create {}: {}", n, std::strerror(errno));
        break;
      }
      ::close(fd);
      if (cancelled()) return out;
    }
    const double create_s = since(t0);
    if (!error.empty()) {
      out.push_back(not_measured("storage.metadata", CheckStatus::kFail, error, t.path));
      continue;
    }
    t0 = Clock::now();
    struct stat st {};
    for (const auto& n : names) ::stat(n.c_str(), &st);
    const double stat_s = since(t0);
    t0 = Clock::now();
    for (const auto& n : names) ::unlink(n.c_str());
    const double unlink_s = since(t0);
    const double total = create_s + stat_s + unlink_s;
    const double nf = static_cast<double>(files);
    out.push_back(measured("storage.metadata", 3 * nf / total,
                           fmt::format("{} files: {:.0f} creates/s, {:.0f} stats/s, {:.0f} unlinks/s", files, nf / create_s,
                                       nf / stat_s, nf / unlink_s), t.path));
  }
  return out;
}

}  // namespace

std::vector<ProbeSpec> storage_probes() {
  const std::vector<ParamSpec> io = {
      {"size", ParamType::kSize, "1GiB", "128MiB", "bytes written and read per path"},
      {"block", ParamType::kSize, "4MiB", "4MiB", "I/O size"},
      {"reserve", ParamType::kSize, "2GiB", "2GiB", "free space that must remain after writing (at least 5% of the filesystem)"}};
  std::vector<ProbeSpec> v;
  v.push_back({"storage.free",
               {{"storage.free", "storage", "GiB", ValueKind::kNumber, Direction::kNone, "free space on each storage path"}},
               {}, "storage", true, 10, 5, run_free});
  v.push_back({"storage.throughput",
               {{"storage.write", "storage", "MB/s", ValueKind::kNumber, Direction::kHigher,
                 "sequential write with O_DIRECT (or buffered + fsync), per path"},
                {"storage.read", "storage", "MB/s", ValueKind::kNumber, Direction::kHigher,
                 "sequential read with O_DIRECT (or after dropping the cache), per path"}},
               io, "storage", true, 120, 20, run_throughput});
  v.push_back({"storage.metadata",
               {{"storage.metadata", "storage", "ops/s", ValueKind::kNumber, Direction::kHigher,
                 "small-file create + stat + unlink operations per second, per path"}},
               {{"files", ParamType::kInteger, 5000, 1000, "files created, stat'ed and removed per path"}},
               "storage", true, 60, 10, run_metadata});
  return v;
}

}  // namespace pacer::vet
