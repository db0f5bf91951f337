// How the way a file first comes into the page cache sets the cost of every later mapping of it.
//
// For each way of filling the cache it drops FILE from the page cache (POSIX_FADV_DONTNEED), fills it
// again that way, then maps the file afresh twice and touches one byte of every 4 KiB page, as a new
// dataset's first epoch does. Ways (rotated within each round):
//   willneed        POSIX_FADV_WILLNEED, then a plain mapping's faults (what pacer did before 2026-12-05)
//   mapped          a plain mapping's faults
//   mapped-huge     a mapping advised MADV_HUGEPAGE (what pacer::MappedFile does now)
//   willneed-huge   POSIX_FADV_WILLNEED, then the advised mapping
//   pread2-huge     a 2-byte pread at offset 0 through another descriptor (the gzip-magic check that
//                   pacer's index check made before the loader mapped a shard, until 2026-12-05), then
//                   the advised mapping
//   read            read(2) in 1 MiB pieces (cat)
// and, on the second touch of an anonymous buffer, 4 KiB pages against MADV_HUGEPAGE (fresh memory).
//
// Build and run (root, or the file's owner; it evicts FILE from the page cache):
//   g++ -O2 -std=c++20 bench/mapping_folios.cpp -o /tmp/mapping_folios && /tmp/mapping_folios FILE [ROUNDS]
// Prints one line per way: the fill's milliseconds and the later fresh mappings' milliseconds and page
// faults (medians over the rounds, with the spread).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

long minor_faults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

volatile unsigned long g_sink = 0;

// Maps the file, optionally advised, touches a byte per page, unmaps. Milliseconds.
double touch_mapping(int fd, std::size_t n, bool huge) {
  const auto t0 = Clock::now();
  auto* p = static_cast<const unsigned char*>(mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0));
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  if (huge) madvise(const_cast<unsigned char*>(p), n, MADV_HUGEPAGE);
  unsigned long s = 0;
  for (std::size_t i = 0; i < n; i += 4096) s += p[i];
  g_sink = g_sink + s;
  munmap(const_cast<unsigned char*>(p), n);
  return ms_since(t0);
}

void evict(int fd) {
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

// A descriptor of its own, as a new process has: the kernel keeps readahead state per open file, and a
// descriptor that earlier rounds read through starts its readahead where they left it.
int open_fresh(const char* path) {
  const int fd = open(path, O_RDONLY);
  if (fd < 0) {
    std::perror(path);
    std::exit(1);
  }
  return fd;
}

double fill(const char* path, std::size_t n, const std::string& way) {
  const int fd = open_fresh(path);
  const auto t0 = Clock::now();
  if (way == "willneed" || way == "willneed-huge") posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
  if (way == "pread2-huge") {
    unsigned char magic[2];
    const int other = open_fresh(path);
    if (pread(other, magic, 2, 0) != 2) std::perror(path);
    close(other);
  }
  if (way == "read") {
    std::vector<char> buf(1 << 20);
    for (off_t at = 0; pread(fd, buf.data(), buf.size(), at) > 0; at += static_cast<off_t>(buf.size())) {
    }
  } else {
    touch_mapping(fd, n, way == "mapped-huge" || way == "willneed-huge" || way == "pread2-huge");
  }
  const double ms = ms_since(t0);
  close(fd);
  return ms;
}

struct Stat {
  double median, lo, hi;
};
Stat summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE [ROUNDS]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const int fd = open(argv[1], O_RDONLY);
  struct stat st{};
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
    std::perror(argv[1]);
    return 2;
  }
  const auto n = static_cast<std::size_t>(st.st_size);
  const std::vector<std::string> ways = {"willneed", "mapped", "mapped-huge", "willneed-huge", "read", "pread2-huge"};
  std::map<std::string, std::vector<double>> fill_ms, remap_ms, remap_faults;
  for (int r = 0; r < rounds; ++r)
    for (std::size_t k = 0; k < ways.size(); ++k) {
      const std::string& way = ways[(k + static_cast<std::size_t>(r)) % ways.size()];
      evict(fd);
      fill_ms[way].push_back(fill(argv[1], n, way));
      for (int again = 0; again < 2; ++again) {
        const int again_fd = open_fresh(argv[1]);
        const long f0 = minor_faults();
        remap_ms[way].push_back(touch_mapping(again_fd, n, false));
        remap_faults[way].push_back(static_cast<double>(minor_faults() - f0));
        close(again_fd);
      }
    }
  std::printf("file %s, %.1f MiB, %d rounds; medians [min-max]\n", argv[1], n / 1048576.0, rounds);
  std::printf("%-14s %-24s %-24s %s\n", "filled by", "fill ms", "fresh mapping ms", "faults");
  for (const auto& way : ways) {
    const Stat f = summarize(fill_ms[way]), m = summarize(remap_ms[way]), q = summarize(remap_faults[way]);
    std::printf("%-14s %7.2f [%.2f-%.2f]   %7.2f [%.2f-%.2f]   %.0f [%.0f-%.0f]\n", way.c_str(), f.median, f.lo, f.hi, m.median, m.lo, m.hi,
                q.median, q.lo, q.hi);
  }
  // First touch of new anonymous memory, 4 KiB pages against huge pages, per 4 KiB (16 MiB buffers kept mapped).
  for (const bool huge : {false, true}) {
    std::vector<double> us;
    for (int r = 0; r < rounds; ++r) {
      const std::size_t len = 16u << 20, align = 2u << 20;
      auto* raw = static_cast<unsigned char*>(mmap(nullptr, len + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      auto* a = reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(raw) + align - 1) / align * align);
      if (huge) madvise(a, len, MADV_HUGEPAGE);
      const auto t0 = Clock::now();
      std::memset(a, 1, len);
      us.push_back(ms_since(t0) * 1000.0 / (len / 4096));
    }
    const Stat s = summarize(us);
    std::printf("anonymous %-9s first touch %.2f us per 4 KiB [%.2f-%.2f]\n", huge ? "huge" : "4 KiB", s.median, s.lo, s.hi);
  }
  return 0;
}
