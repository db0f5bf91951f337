// Which parts of a file the page cache holds in 2 MiB folios, seen from a fresh mapping.
//
// For each FILE: maps it at a 2 MiB-aligned address, advised MADV_HUGEPAGE, touches one byte of every
// 4 KiB page and prints the minor faults each 2 MiB of the file took. 1: the 2 MiB are one folio,
// mapped by one page-table entry; 32: small folios, mapped 64 KiB per fault (fault-around); 0 or more
// than 1 on the last, partial, 2 MiB. Pages not cached are read from the disk by these faults, in 2 MiB
// folios, so it says something only of files that are cached whole.
//
//   g++ -O2 -std=c++20 bench/pmd_faults.cpp -o /tmp/pmd_faults && /tmp/pmd_faults FILE...
//
// bench/results/loader_fresh-2026-12-05/folios-after-read-back.txt: shards dropped from the page
// cache (POSIX_FADV_DONTNEED), one shuffled epoch of a freshly opened pacer dataset over them
// (bench/loader_vs_torch.py's time_pacer), then this.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr std::size_t kHuge = 2u << 20;

long minor_faults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt + r.ru_majflt;
}

volatile unsigned long g_sink = 0;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE...\n", argv[0]);
    return 2;
  }
  for (int a = 1; a < argc; ++a) {
    const int fd = open(argv[a], O_RDONLY);
    struct stat st{};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
      std::perror(argv[a]);
      return 2;
    }
    const auto n = static_cast<std::size_t>(st.st_size);
    // Reserve n + 2 MiB, then map the file at the first 2 MiB boundary inside.
    void* room = mmap(nullptr, n + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (room == MAP_FAILED) {
      std::perror("mmap");
      return 2;
    }
    const std::uintptr_t at = (reinterpret_cast<std::uintptr_t>(room) + kHuge - 1) / kHuge * kHuge;
    auto* p = static_cast<const unsigned char*>(mmap(reinterpret_cast<void*>(at), n, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0));
    if (p == MAP_FAILED) {
      std::perror("mmap");
      return 2;
    }
    madvise(const_cast<unsigned char*>(p), n, MADV_HUGEPAGE);
    std::printf("%s:", argv[a]);
    for (std::size_t lo = 0; lo < n; lo += kHuge) {
      const long f0 = minor_faults();
      unsigned long s = 0;
      for (std::size_t o = lo; o < n && o < lo + kHuge; o += 4096) s += p[o];
      g_sink = g_sink + s;
      std::printf(" %ld", minor_faults() - f0);
    }
    std::printf("\n");
    munmap(room, n + kHuge);
    close(fd);
  }
  return 0;
}
