#include "pacer/core/mapped_file.hpp"

#include <fmt/format.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "pacer/core/posix_io.hpp"

namespace pacer {

namespace {

// The copy a thread is inside, if any. Set only around the memcpy; the
// handler reads it on the faulting thread.
struct Guard {
  sigjmp_buf env;
};
thread_local Guard* t_guard = nullptr;

struct sigaction g_previous {};
std::mutex g_install_mu;
std::atomic<bool> g_chaining{false};

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  if (Guard* g = t_guard) {
    // Not checking si_addr: a handler installed after this one that chains
    // to it (faulthandler) re-raises the signal, with no fault address.
    t_guard = nullptr;
    siglongjmp(g->env, 1);
  }
  // Not a guarded copy: what would have happened without this handler. A
  // handler that chains back here (installed after this one, and this one
  // installed again over it) would loop: the second time round, the default.
  const bool again = g_chaining.exchange(true);
  if (!again && (g_previous.sa_flags & SA_SIGINFO)) {
    if (g_previous.sa_sigaction) g_previous.sa_sigaction(sig, info, ctx);
    g_chaining = false;
    return;
  }
  if (!again && g_previous.sa_handler == SIG_IGN) {
    g_chaining = false;
    return;
  }
  if (!again && g_previous.sa_handler != SIG_DFL) {
    g_previous.sa_handler(sig);
    g_chaining = false;
    return;
  }
  ::signal(sig, SIG_DFL);
  // A fault re-executes the instruction and dies of the default action; a
  // sent signal has to be sent again.
  if (again || info == nullptr || info->si_code <= 0) ::raise(sig);
}

// Installs the handler unless it is the one in place: at every mapping, so
// one installed since without chaining to it (PyTorch's DataLoader workers
// install theirs) does not leave later mappings unguarded.
void install_handler() {
  std::lock_guard lock(g_install_mu);
  struct sigaction now {};
  if (::sigaction(SIGBUS, nullptr, &now) == 0 && (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return;
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  // SA_NODEFER: siglongjmp leaves the handler without restoring the signal
  // mask (sigsetjmp(env, 0) is cheaper than saving it), so SIGBUS must not
  // be blocked while it runs. SA_ONSTACK: a thread with an alternate signal
  // stack keeps using it.
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &g_previous);
}

// Kept out of line and free of objects with destructors: siglongjmp skips
// whatever lies between it and the sigsetjmp.
[[gnu::noinline]] bool guarded(MappedFile::Reader fn, const unsigned char* src, std::size_t n, void* ctx) {
  Guard g;
  if (sigsetjmp(g.env, 0) != 0) return false;
  // A chained handler that left by longjmp (another library's guard) never
  // cleared the loop flag; a copy here is outside any handler. Read first:
  // a store per copy would bounce the line between the reader threads.
  if (g_chaining.load(std::memory_order_relaxed)) g_chaining.store(false, std::memory_order_relaxed);
  t_guard = &g;
  // The handler runs on this thread: a signal fence keeps the stores to
  // t_guard on their side of the reads.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  fn(src, n, ctx);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return true;
}

void copy_to(const unsigned char* src, std::size_t n, void* dst) { std::memcpy(dst, src, n); }

}  // namespace

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      local_(std::exchange(o.local_, false)),
      path_(std::move(o.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
    fd_ = std::exchange(o.fd_, -1);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    local_ = std::exchange(o.local_, false);
    path_ = std::move(o.path_);
  }
  return *this;
}

Expected<MappedFile> MappedFile::map(int fd, const std::string& path) {
  install_handler();
  struct stat st {};
  if (::fstat(fd, &st) != 0) return io_error("fstat", path, errno);
  MappedFile m;
  m.fd_ = fd;
  m.path_ = path;
  if (st.st_size <= 0) return m;
  if (static_cast<std::uint64_t>(st.st_size) > SIZE_MAX) return Error{ErrorKind::kIo, fmt::format("{}: too large to map", path)};
  void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return io_error("mmap", path, errno);
  m.data_ = static_cast<const unsigned char*>(p);
  m.size_ = static_cast<std::uint64_t>(st.st_size);
  // Pages this mapping reads from the disk then come into the page cache as
  // 2 MiB folios where the file system has large folios, and every later
  // mapping of them (another process, a dataset opened again) fills one page
  // table entry per 2 MiB instead of 512: on a guest whose page-table updates
  // trap to the host, a fresh mapping of a 56 MiB shard took 0.6-1.0 ms to
  // read through instead of 19-23 ms (bench/results/loader_folios-2026-12-05.md).
  // Pages already cached keep the folios they have. Advice only: where THP
  // is off, or the kernel ignores it for files, nothing changes.
  (void)::madvise(p, static_cast<std::size_t>(st.st_size), MADV_HUGEPAGE);
  // Only a local file system's truncation unmaps this process's pages at
  // once (check_size): on NFS or FUSE a cut made elsewhere reaches the client
  // only when it next asks for the file's attributes, as fstat does.
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0)
    switch (static_cast<unsigned long>(fs.f_type)) {
      case EXT4_SUPER_MAGIC:
      case XFS_SUPER_MAGIC:
      case BTRFS_SUPER_MAGIC:
      case TMPFS_MAGIC:
        m.local_ = true;
        break;
      default:
        break;
    }
  return m;
}

namespace {
void touch_byte(const unsigned char* p, std::size_t, void*) { (void)*static_cast<const volatile unsigned char*>(p); }
}  // namespace

Status MappedFile::check_size(std::uint64_t end) const {
  // On a local file system a file cut below a page unmaps that page and
  // every later one from all mappings: a read there faults (SIGBUS), while a
  // read of a page the file still reaches does not. So when `end` lies below the last page mapped,
  // one guarded read of the mapping's last byte proves the file still holds
  // `end` bytes, without the fstat (a system call, a few microseconds on a
  // KVM guest, paid per batch and shard). A cut inside that last page would
  // not fault: reads ending there take the fstat.
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  if (local_ && data_ && size_ > 0 && end <= (size_ - 1) / page * page && guarded(touch_byte, data_ + size_ - 1, 1, nullptr)) return {};
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return io_error("fstat", path_, errno);
  const auto now = static_cast<std::uint64_t>(st.st_size);
  if (now >= end) return {};
  return Error{ErrorKind::kIo, fmt::format("{}: offset {}: unexpected end of file: truncated while open (it had {} bytes when opened)", path_, now, size_)};
}

bool MappedFile::map_pages_if_cached() const {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14; older headers lack it
#endif
#ifndef __NR_cachestat
  constexpr long __NR_cachestat = 451;  // the same on every architecture since Linux 6.5
#endif
  // Larger files are left to fault: in small folios populating takes 2 ms
  // per 56 MB on the 2-core VM (bench/results/first_touch-2026-12-06.md),
  // seconds for a file of many GiB before its first read returns.
  constexpr std::uint64_t kMax = 1ull << 30;
  if (!data_ || size_ == 0 || size_ > kMax) return false;
  struct {
    std::uint64_t off = 0, len = 0;  // len 0: to the end of the file
  } range;
  struct {
    std::uint64_t cache, dirty, writeback, evicted, recently_evicted;
  } stat{};
  if (::syscall(__NR_cachestat, fd_, &range, &stat, 0) != 0) return false;
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  // A few pages missing (evicted under memory pressure) are read by the
  // call itself: at most 2 MiB, never the file.
  const std::uint64_t pages = (size_ + page - 1) / page;
  if (stat.cache < pages && (pages - stat.cache) * page > (2u << 20)) return false;
  // Pages evicted meanwhile are read too (a race, not the rule); a file cut
  // meanwhile fails the call (EFAULT), which leaves reads to fault.
  return ::madvise(const_cast<unsigned char*>(data_), static_cast<std::size_t>(size_), MADV_POPULATE_READ) == 0;
}

void MappedFile::prefetch(std::uint64_t offset, std::size_t n) const {
  if (offset > size_ || n > size_ - offset || n == 0) return;
  // The first two lines of each page the range touches: the hardware
  // prefetcher follows a stream within a page but starts again at each page
  // boundary. Prefetching every line instead filled the core's miss buffers
  // and stalled it as long as the copy would have (measured in
  // bench/results/loader_speed-2026-12-01.md).
  const unsigned char* p = data_ + offset;
  const unsigned char* end = p + n;
  for (const unsigned char* q = p; q < end;) {
    __builtin_prefetch(q, 0, 3);
    if (q + 64 < end) __builtin_prefetch(q + 64, 0, 3);
    q = reinterpret_cast<const unsigned char*>((reinterpret_cast<std::uintptr_t>(q) | 4095) + 1);
  }
}

Status MappedFile::copy(std::uint64_t offset, std::size_t n, void* dst) const { return read(offset, n, copy_to, dst); }

Status MappedFile::read(std::uint64_t offset, std::size_t n, Reader fn, void* ctx) const {
  if (offset > size_ || n > size_ - offset)
    return Error{ErrorKind::kIo, fmt::format("{}: offset {}: unexpected end of file ({} bytes asked for at offset {}; it had {} bytes when opened)", path_,
                                             size_, n, offset, size_)};
  if (n == 0) return {};
  if (!guarded(fn, data_ + offset, n, ctx)) {
    if (Status st = check_size(offset + n); !st) return st;
    return Error{ErrorKind::kIo, fmt::format("{}: offset {}: {} bytes: unreadable (SIGBUS reading its mapping)", path_, offset, n)};
  }
  return {};
}

}  // namespace pacer
