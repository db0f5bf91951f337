// What the first write to fresh anonymous memory costs, per 4 KiB page, and how much of it
// MADV_POPULATE_WRITE or 2 MiB pages take away.
//
// For each way, ROUNDS times: maps SIZE bytes (a 2 MiB-aligned address), prepares them that way,
// writes one byte of every 64 (the first pass: page faults, and on a guest whose page tables the
// host shadows, the host's first sight of each page), then writes them again (the second pass:
// memory already mapped, the floor). Prints the medians, in microseconds and per 4 KiB page.
//
//   fault      nothing: the first pass faults once per 4 KiB (THP off for the range)
//   populate   MADV_POPULATE_WRITE first (one system call), 4 KiB pages
//   huge       MADV_HUGEPAGE: one fault per 2 MiB
//
// With FILE (one the page cache holds), the same for a fresh read-only mapping of it, advised
// MADV_HUGEPAGE as pacer maps shards (MappedFile::map), reading a byte per 4 KiB page:
//
//   file-fault      the reads fault: once per 2 MiB folio, once per 64 KiB of small ones
//   file-populate   MADV_POPULATE_READ first, as MappedFile::map_pages_if_cached does
//
//   g++ -O2 -std=c++20 bench/first_touch.cpp -o /tmp/first_touch && /tmp/first_touch [SIZE_MIB] [ROUNDS] [FILE]
//
// Why: pacer's index tables and read buffers are written once, right after they are allocated
// (SampleTable::reserve, check_index), so a freshly opened dataset pays this per page it allocates;
// bench/results/first_touch-2026-12-06.md.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

constexpr std::size_t kHuge = 2u << 20;

double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Pass {
  double prepare = 0, first = 0, second = 0;
};

Pass one(std::size_t bytes, const char* way) {
  const std::size_t total = bytes + kHuge;
  void* raw = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    std::perror("mmap");
    std::exit(3);
  }
  auto* p = reinterpret_cast<volatile unsigned char*>((reinterpret_cast<std::uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  void* q = const_cast<unsigned char*>(p);
  Pass r;
  const double t0 = now_us();
  const std::string_view w(way);
  if (w == "huge") {
    (void)::madvise(q, bytes, MADV_HUGEPAGE);
  } else {
    (void)::madvise(q, bytes, MADV_NOHUGEPAGE);
    if (w == "populate" && ::madvise(q, bytes, MADV_POPULATE_WRITE) != 0) {
      std::perror("madvise(MADV_POPULATE_WRITE)");
      std::exit(3);
    }
  }
  const double t1 = now_us();
  for (std::size_t i = 0; i < bytes; i += 64) p[i] = 1;
  const double t2 = now_us();
  for (std::size_t i = 0; i < bytes; i += 64) p[i] = 2;
  const double t3 = now_us();
  ::munmap(raw, total);
  r.prepare = t1 - t0;
  r.first = t2 - t1;
  r.second = t3 - t2;
  return r;
}

Pass one_file(const char* path, bool populate, std::size_t& bytes) {
  const int fd = ::open(path, O_RDONLY);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size <= 0) {
    std::perror(path);
    std::exit(3);
  }
  bytes = static_cast<std::size_t>(st.st_size);
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    std::perror("mmap");
    std::exit(3);
  }
  (void)::madvise(m, bytes, MADV_HUGEPAGE);
  const auto* p = static_cast<const volatile unsigned char*>(m);
  Pass r;
  unsigned sum = 0;
  const double t0 = now_us();
  if (populate && ::madvise(m, bytes, MADV_POPULATE_READ) != 0) {
    std::perror("madvise(MADV_POPULATE_READ)");
    std::exit(3);
  }
  const double t1 = now_us();
  for (std::size_t i = 0; i < bytes; i += 4096) sum += p[i];
  const double t2 = now_us();
  for (std::size_t i = 0; i < bytes; i += 4096) sum += p[i];
  const double t3 = now_us();
  ::munmap(m, bytes);
  ::close(fd);
  if (sum == 1) std::puts("");  // keeps the reads
  r.prepare = t1 - t0;
  r.first = t2 - t1;
  r.second = t3 - t2;
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 8;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 9;
  if (mib == 0 || rounds <= 0) {
    std::fprintf(stderr, "usage: first_touch [SIZE_MIB] [ROUNDS]\n");
    return 2;
  }
  const char* file = argc > 3 ? argv[3] : nullptr;
  const std::size_t bytes = mib << 20;
  std::size_t file_bytes = 0;
  const char* ways[] = {"fault", "populate", "huge", "file-fault", "file-populate"};
  const int nways = file ? 5 : 3;
  std::vector<Pass> runs[5];
  // The ways alternate within each round, so that a noisy neighbour hits them alike.
  for (int r = 0; r < rounds; ++r)
    for (int w = 0; w < nways; ++w) runs[w].push_back(w < 3 ? one(bytes, ways[w]) : one_file(file, w == 4, file_bytes));
  std::printf("anonymous %zu MiB%s%s, %d rounds, medians (per 4 KiB page)\n", mib, file ? "; file " : "", file ? file : "", rounds);
  std::printf("%-13s %16s %22s %22s %10s\n", "way", "prepare us", "first pass us", "second pass us", "first/2nd");
  for (int w = 0; w < nways; ++w) {
    const double pages = static_cast<double>(w < 3 ? bytes : file_bytes) / 4096;
    std::vector<double> pr, fi, se;
    for (const auto& p : runs[w]) {
      pr.push_back(p.prepare);
      fi.push_back(p.first);
      se.push_back(p.second);
    }
    const double a = median(pr), b = median(fi), c = median(se);
    std::printf("%-13s %8.0f (%5.2f) %14.0f (%5.2f) %14.0f (%5.2f) %10.1f\n", ways[w], a, a / pages, b, b / pages, c, c / pages, b / c);
  }
  return 0;
}
