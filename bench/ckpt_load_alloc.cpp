// Where a cold checkpoint load's time goes on a VM: O_DIRECT reads of one
// file into freshly mapped memory, with the destination backed by 4 KiB or
// transparent huge pages, with several reads in flight, with a thread that
// faults the destination in ahead of the reads, and into memory faulted in
// beforehand (the disk alone). Modes alternate within each round; before
// every timed read the file is evicted (fdatasync, POSIX_FADV_DONTNEED,
// drop_caches where permitted) and the machine idles SETTLE seconds, so that
// memory freed by the previous mode can go back to the host (as in
// ckpt_vs_torch.py).
//
//   g++ -O2 -pthread -o /tmp/ckpt_load_alloc bench/ckpt_load_alloc.cpp
//   /tmp/ckpt_load_alloc FILE [ROUNDS=3] [SETTLE_S=3]
//
// FILE: an existing file of random bytes (a multiple of 64 MiB), e.g.
// head -c 2147483648 /dev/urandom > FILE. Prints one JSON object.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kChunk = 64u << 20;
constexpr std::size_t kHuge = 2u << 20;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void evict(const char* path) {
  const int fd = ::open(path, O_RDONLY);
  if (fd >= 0) {
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  const int d = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (d >= 0) {
    if (::write(d, "1", 1) != 1) std::fprintf(stderr, "drop_caches not written\n");
    ::close(d);
  }
}

struct Mode {
  const char* name;
  bool huge;      // MADV_HUGEPAGE on the destination
  bool prefault;  // faulted in before the clock starts: the disk alone
  bool ahead;     // a thread faults chunks in (MADV_POPULATE_WRITE) ahead of the readers
  int readers;
};

double run(const char* path, std::size_t bytes, const Mode& m) {
  void* p = ::mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  auto* buf = reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(p) + kHuge - 1) / kHuge * kHuge);
  if (m.huge) ::madvise(buf, bytes, MADV_HUGEPAGE);
  if (m.prefault) std::memset(buf, 1, bytes);
  const std::size_t chunks = bytes / kChunk;
  const auto t0 = Clock::now();
  std::atomic<std::size_t> next{0};
  std::vector<std::atomic<bool>> ready(chunks);
  for (auto& r : ready) r = !m.ahead;
  std::thread faulter;
  if (m.ahead)
    faulter = std::thread([&] {
      for (std::size_t c = 0; c < chunks; ++c) {
        ::madvise(buf + c * kChunk, kChunk, MADV_POPULATE_WRITE);
        ready[c] = true;
      }
    });
  auto reader = [&] {
    const int fd = ::open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
      std::perror("open O_DIRECT");
      std::exit(1);
    }
    for (std::size_t c; (c = next.fetch_add(1)) < chunks;) {
      while (!ready[c]) std::this_thread::yield();
      for (std::size_t done = 0; done < kChunk;) {
        const ssize_t n = ::pread(fd, buf + c * kChunk + done, kChunk - done, static_cast<off_t>(c * kChunk + done));
        if (n <= 0) {
          std::perror("pread");
          std::exit(1);
        }
        done += static_cast<std::size_t>(n);
      }
    }
    ::close(fd);
  };
  std::vector<std::thread> more;
  for (int i = 1; i < m.readers; ++i) more.emplace_back(reader);
  reader();
  for (auto& t : more) t.join();
  if (faulter.joinable()) faulter.join();
  const double s = seconds_since(t0);
  ::munmap(p, bytes + kHuge);
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE [ROUNDS] [SETTLE_S]\n", argv[0]);
    return 2;
  }
  const char* path = argv[1];
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const double settle = argc > 3 ? std::atof(argv[3]) : 3;
  struct stat st {};
  if (::stat(path, &st) != 0 || st.st_size < static_cast<off_t>(kChunk)) {
    std::fprintf(stderr, "%s: missing or smaller than 64 MiB\n", path);
    return 2;
  }
  const std::size_t bytes = static_cast<std::size_t>(st.st_size) / kChunk * kChunk;
  const std::vector<Mode> modes = {
      {"4k_2_readers", false, false, false, 2},   {"huge_2_readers", true, false, false, 2},
      {"4k_4_readers", false, false, false, 4},   {"huge_4_readers", true, false, false, 4},
      {"4k_2_readers_fault_ahead", false, false, true, 2}, {"prefaulted_2_readers", false, true, false, 2},
  };
  std::vector<std::vector<double>> times(modes.size());
  double load_before[3] = {0, 0, 0}, load_after[3] = {0, 0, 0};
  (void)::getloadavg(load_before, 3);
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t k = 0; k < modes.size(); ++k) {
      const std::size_t i = (k + static_cast<std::size_t>(r)) % modes.size();  // rotate the order
      evict(path);
      ::sync();
      std::this_thread::sleep_for(std::chrono::duration<double>(settle));
      times[i].push_back(run(path, bytes, modes[i]));
    }
  }
  (void)::getloadavg(load_after, 3);
  std::printf("{\"bytes\": %zu, \"rounds\": %d, \"settle_s\": %.1f, \"loadavg_1m_before\": %.2f, \"loadavg_1m_after\": %.2f, \"modes\": {",
              bytes, rounds, settle, load_before[0], load_after[0]);
  for (std::size_t i = 0; i < modes.size(); ++i) {
    std::printf("%s\"%s\": {\"median_s\": %.3f, \"MB_per_s\": %.1f, \"runs_s\": [", i ? ", " : "", modes[i].name, median(times[i]),
                bytes / 1e6 / median(times[i]));
    for (std::size_t j = 0; j < times[i].size(); ++j) std::printf("%s%.3f", j ? ", " : "", times[i][j]);
    std::printf("]}");
  }
  std::printf("}}\n");
  return 0;
}
