#include "pacer/core/mapped_file.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "test_util.hpp"

namespace pacer {
namespace {

namespace fs = std::filesystem;
using test::contains;

constexpr std::size_t kPage = 4096;

std::string pattern(std::size_t n) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 131 + 7);
  return s;
}

struct Mapped {
  test::TempDir dir{"pacer_mapped_file_"};
  std::string path = (fs::path(dir.path()) / "f.bin").string();
  std::string data = pattern(5 * kPage + 123);
  Fd fd;
  MappedFile map;
  Mapped() {
    dir.file("f.bin", data);
    auto f = open_fd(path, O_RDONLY);
    if (!f) throw std::runtime_error(f.error().message);
    fd = std::move(*f);
    auto m = MappedFile::map(fd.get(), path);
    if (!m) throw std::runtime_error(m.error().message);
    map = std::move(*m);
  }
};

TEST(MappedFile, CopiesExactBytesAndRefusesRangesPastTheSizeMapped) {
  Mapped m;
  ASSERT_EQ(m.map.size(), m.data.size());
  std::string got(1000, '\0');
  ASSERT_TRUE(m.map.copy(3 * kPage - 10, got.size(), got.data()));
  EXPECT_EQ(got, m.data.substr(3 * kPage - 10, got.size()));
  EXPECT_TRUE(m.map.check_size(m.data.size()));
  auto past = m.map.copy(m.data.size() - 10, 11, got.data());
  ASSERT_FALSE(past);
  EXPECT_TRUE(contains(past.error().message, m.path));
  EXPECT_TRUE(contains(past.error().message, "unexpected end of file"));
  // An offset near 2^64 does not wrap past the check.
  EXPECT_FALSE(m.map.copy(~std::uint64_t{0} - 5, 10, got.data()));
}

TEST(MappedFile, TruncatedWhileMappedIsAnErrorNamingTheFileNeverASigbus) {
  Mapped m;
  const std::uint64_t cut = kPage + 100;
  fs::resize_file(m.path, cut);
  std::string got(2 * kPage, '\0');
  // Whole pages past the new end fault: the guard turns it into an error.
  auto gone = m.map.copy(3 * kPage, kPage, got.data());
  ASSERT_FALSE(gone);
  EXPECT_TRUE(contains(gone.error().message, m.path)) << gone.error().message;
  EXPECT_TRUE(contains(gone.error().message, "truncated while open")) << gone.error().message;
  EXPECT_TRUE(contains(gone.error().message, fmt::format("offset {}", cut))) << gone.error().message;
  // A copy that crosses from the kept bytes into the lost pages fails too.
  EXPECT_FALSE(m.map.copy(kPage - 10, 2 * kPage, got.data()));
  // Inside the new last page the mapping reads zeros without faulting:
  // only the size check tells.
  ASSERT_TRUE(m.map.copy(cut - 10, 50, got.data()));
  EXPECT_FALSE(m.map.check_size(cut + 40));
  EXPECT_TRUE(m.map.check_size(cut));
  // The bytes the file kept still read exactly, and the guard stays armed
  // for the next fault.
  ASSERT_TRUE(m.map.copy(0, cut, got.data()));
  EXPECT_EQ(got.substr(0, cut), m.data.substr(0, cut));
  EXPECT_FALSE(m.map.copy(4 * kPage, 10, got.data()));
}

// check_size answers from one read of the mapping's last page when the end
// asked about lies below that page (a cut below a page unmaps it, also pages
// this process had mapped already), and from fstat otherwise: every kind of
// cut gives the answer fstat would, for a small file and for one of 2 MiB
// pages (mapped whole where the page cache holds it so).
TEST(MappedFile, SizeChecksAgreeWithTheFileWhereverItWasCut) {
  for (const std::uint64_t size : {std::uint64_t{5 * kPage + 123}, std::uint64_t{(4u << 20) + 123}}) {
    const std::uint64_t last = (size - 1) / kPage * kPage;  // the last page's start
    struct Case {
      std::uint64_t cut;
      const char* what;
    };
    for (const Case c : {Case{size, "not cut"}, Case{last + 50, "inside the last page"}, Case{last, "at the last page's start"},
                         Case{3 * kPage + 7, "pages below the last"}, Case{0, "to nothing"}}) {
      test::TempDir dir{"pacer_mapped_cut_"};
      const std::string path = dir.file("f.bin", pattern(static_cast<std::size_t>(size)));
      auto fd = open_fd(path, O_RDONLY);
      ASSERT_TRUE(fd) << fd.error().message;
      auto map = MappedFile::map(fd->get(), path);
      ASSERT_TRUE(map) << map.error().message;
      // Every page mapped and read before the cut.
      std::string all(static_cast<std::size_t>(size), '\0');
      ASSERT_TRUE(map->copy(0, size, all.data()));
      ASSERT_TRUE(map->check_size(size));
      fs::resize_file(path, c.cut);
      for (std::uint64_t end : {std::uint64_t{1}, kPage, 3 * kPage, 3 * kPage + 7, 3 * kPage + 8, last, last + 50, last + 51, size}) {
        auto st = map->check_size(end);
        EXPECT_EQ(static_cast<bool>(st), end <= c.cut) << size << " bytes, " << c.what << ", end " << end;
        if (!st) {
          EXPECT_TRUE(contains(st.error().message, "truncated while open")) << st.error().message;
          EXPECT_TRUE(contains(st.error().message, path)) << st.error().message;
        }
      }
    }
  }
  // A file that grew since it was mapped still holds every byte mapped.
  Mapped m;
  fs::resize_file(m.path, 9 * kPage);
  EXPECT_TRUE(m.map.check_size(m.data.size()));
  EXPECT_TRUE(m.map.check_size(kPage));
}

// The VmFlags line of the mapping whose smaps header names `name`, or "".
std::string vm_flags(const std::string& name) {
  auto smaps = read_file("/proc/self/smaps");
  if (!smaps) return "";
  const auto at = smaps->find(name);
  if (at == std::string::npos) return "";
  const auto flags = smaps->find("VmFlags:", at);
  if (flags == std::string::npos) return "";
  return smaps->substr(flags, smaps->find('\n', flags) - flags);
}

TEST(MappedFile, TheMappingIsAdvisedAsHugePages) {
  if (!fs::exists("/sys/kernel/mm/transparent_hugepage/enabled")) GTEST_SKIP() << "kernel without transparent huge pages";
  // A control: another file, mapped and advised here. Where its flag does not
  // show (an emulator such as qemu-user drops the advice), there is nothing to see.
  test::TempDir dir{"pacer_mapped_control_"};
  const std::string control = dir.file("control.bin", pattern(3 * kPage));
  auto cfd = open_fd(control, O_RDONLY);
  ASSERT_TRUE(cfd) << cfd.error().message;
  void* p = ::mmap(nullptr, 3 * kPage, PROT_READ, MAP_SHARED, cfd->get(), 0);
  ASSERT_NE(p, MAP_FAILED);
  const bool advised = ::madvise(p, 3 * kPage, MADV_HUGEPAGE) == 0;
  const std::string control_flags = vm_flags(control);
  ::munmap(p, 3 * kPage);
  if (!advised) GTEST_SKIP() << "madvise(MADV_HUGEPAGE) refused for a file mapping";
  Mapped m;
  std::string got(16, '\0');
  ASSERT_TRUE(m.map.copy(0, got.size(), got.data()));
  const std::string line = vm_flags(m.path);
  ASSERT_FALSE(line.empty()) << "no smaps entry for " << m.path;
  if (!contains(control_flags, " hg")) GTEST_SKIP() << "this process's smaps does not show madvise flags: " << control_flags;
  EXPECT_TRUE(contains(line, " hg")) << line;
}

TEST(MappedFile, ThreadsFaultingAtOnceEachGetTheirError) {
  Mapped m;
  fs::resize_file(m.path, kPage);
  std::vector<int> errors(4, 0);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::string got(kPage, '\0');
      for (int i = 0; i < 200; ++i) {
        if (!m.map.copy((1 + (i + t) % 4) * kPage, kPage, got.data())) ++errors[t];
        if (!m.map.copy(0, 100, got.data()) || got.substr(0, 100) != m.data.substr(0, 100)) errors[t] += 1000;
      }
    });
  for (auto& t : ts) t.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(errors[t], 200) << t;
}

// A SIGBUS outside a guarded copy is not swallowed: the process dies of it
// as it would without the guard's handler.
TEST(MappedFile, ASigbusOutsideACopyStillKillsTheProcess) {
  Mapped m;  // installs the handler
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    void* p = ::mmap(nullptr, 2 * kPage, PROT_READ, MAP_SHARED, m.fd.get(), 0);
    if (p == MAP_FAILED) ::_exit(3);
    if (::ftruncate(::open(m.path.c_str(), O_WRONLY), 0) != 0) ::_exit(4);
    volatile const char* c = static_cast<const char*>(p) + kPage;
    (void)*c;
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  // Killed by the signal, or, under a sanitizer whose handler came first,
  // its report and a failing exit; never the 0 of a swallowed fault.
  const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
  const bool reported = WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 3 && WEXITSTATUS(status) != 4;
  EXPECT_TRUE(killed || reported) << status;
}

// A handler installed over the guard's that does not chain to it (as
// PyTorch's DataLoader workers install) is replaced again by the next map().
TEST(MappedFile, TheNextMapInstallsTheGuardAgainOverAnotherHandler) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    Mapped first;
    struct sigaction other {};
    other.sa_handler = [](int) { ::_exit(7); };
    sigemptyset(&other.sa_mask);
    ::sigaction(SIGBUS, &other, nullptr);
    Mapped second;
    fs::resize_file(second.path, kPage);
    std::string got(kPage, '\0');
    auto st = second.map.copy(3 * kPage, kPage, got.data());
    ::_exit(!st && contains(st.error().message, "truncated while open") ? 0 : 5);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif

// Pages of `fd` the page cache holds (cachestat), or -1 where the kernel has
// no cachestat (before Linux 6.5).
long long cached_pages(int fd) {
  struct {
    std::uint64_t off = 0, len = 0;
  } range;
  std::uint64_t stat[5] = {};
  if (::syscall(__NR_cachestat, fd, &range, stat, 0) != 0) return -1;
  return static_cast<long long>(stat[0]);
}

long thread_minor_faults() {
  rusage r{};
  ::getrusage(RUSAGE_THREAD, &r);
  return r.ru_minflt;
}

struct Big {
  test::TempDir dir{"pacer_mapped_cached_"};
  std::string data = pattern(8u << 20);
  std::string path = dir.file("big.bin", data);
  Fd fd;
  Big() {
    auto f = open_fd(path, O_RDONLY);
    if (!f) throw std::runtime_error(f.error().message);
    fd = std::move(*f);
  }
  MappedFile map() const {
    auto m = MappedFile::map(fd.get(), path);
    if (!m) throw std::runtime_error(m.error().message);
    return std::move(*m);
  }
};

TEST(MappedFile, ACachedFileIsMappedWholeAtOnceAndReadsWithoutFaults) {
  Big b;
  std::string got(b.data.size(), '\0');
  ASSERT_TRUE(pread_full(b.fd.get(), got.data(), got.size(), 0, b.path));  // in the page cache now
  if (cached_pages(b.fd.get()) < 0) GTEST_SKIP() << "no cachestat (Linux 6.5)";
  const MappedFile m = b.map();
  ASSERT_TRUE(m.map_pages_if_cached());
  // Every page is mapped already: reading them all faults no more.
  const long before = thread_minor_faults();
  std::fill(got.begin(), got.end(), '\0');
  ASSERT_TRUE(m.copy(0, got.size(), got.data()));
  EXPECT_EQ(thread_minor_faults() - before, 0);
  EXPECT_TRUE(got == b.data);
}

TEST(MappedFile, AFileNotCachedIsNotReadToMapIt) {
  Big b;
  if (cached_pages(b.fd.get()) < 0) GTEST_SKIP() << "no cachestat (Linux 6.5)";
  ASSERT_EQ(::fdatasync(b.fd.get()), 0);  // dirty pages are not dropped
  ASSERT_EQ(::posix_fadvise(b.fd.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
  const long long left = cached_pages(b.fd.get());
  if (left * 4096 > (4 << 20)) GTEST_SKIP() << "the page cache kept " << left << " pages of " << b.path;
  const MappedFile m = b.map();
  EXPECT_FALSE(m.map_pages_if_cached());
  // Nothing was read for it: a reader of a few bytes reads a few pages.
  EXPECT_LE(cached_pages(b.fd.get()), left + 2 * 512);  // the mapping's own first read: 2 MiB folios at most
  std::string got(16, '\0');
  ASSERT_TRUE(m.copy(5u << 20, got.size(), got.data()));
  EXPECT_EQ(got, b.data.substr(5u << 20, 16));
}

TEST(MappedFile, AnEmptyFileHasNothingToMap) {
  test::TempDir dir{"pacer_mapped_empty_"};
  const std::string path = dir.file("empty.bin", "");
  auto f = open_fd(path, O_RDONLY);
  ASSERT_TRUE(f);
  auto m = MappedFile::map(f->get(), path);
  ASSERT_TRUE(m);
  EXPECT_FALSE(m->map_pages_if_cached());
}

}  // namespace
}  // namespace pacer
