// The floor under the shuffled-epoch loader: what copying the bytes of
// bench/loader_vs_torch.py's shards costs with nothing else around it.
//
// Usage: loader_copy_floor DIR [SHARDS] [SAMPLES_PER_SHARD]
// DIR holds bench-000000.tar .. (the layout loader_vs_torch.py writes with
// --size 10240: per sample a 512-byte header, 10,240 bytes, a header and a
// JSON member under 512 bytes, so sample k's span, its first field's data to
// the end of its last, is 10,792 bytes at k * 11,776 + 512). Prints the CPU
// seconds (user + system) of one epoch of each way of reading them, best of
// 7 after 2 warm-ups: from a mapping in file order and shuffled, with and
// without a prefetch of the next sample, into one reused buffer or rotating
// batch buffers; a fresh mapping per epoch (page tables filled again) with
// and without MADV_POPULATE_READ / MADV_HUGEPAGE; pread per sample; and
// pread of 128 KiB in file order, which is what `cat` does. Built where
// liburing's header is (apt-get install liburing-dev; link with -luring), it
// also reads the shuffled spans through io_uring, a batch's reads per submit:
// what a loader that reads instead of mapping could reach.
#include <fcntl.h>
#if __has_include(<liburing.h>)
#include <liburing.h>
#define FLOOR_HAVE_URING 1
#endif
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

double cpu_seconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) + 1e-6 * static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

constexpr std::size_t kStride = 11776, kSpan = 10792;

void prefetch_pages(const unsigned char* p, std::size_t n) {
  for (const unsigned char* q = p; q < p + n;) {
    __builtin_prefetch(q);
    __builtin_prefetch(q + 64);
    q = reinterpret_cast<const unsigned char*>((reinterpret_cast<std::uintptr_t>(q) | 4095) + 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [SHARDS] [SAMPLES_PER_SHARD]\n", argv[0]);
    return 2;
  }
  const int shards = argc > 2 ? std::atoi(argv[2]) : 8;
  const std::size_t per = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 5000;
  std::vector<int> fds;
  std::vector<std::size_t> sizes;
  std::vector<const unsigned char*> maps;
  for (int s = 0; s < shards; ++s) {
    const std::string path = std::string(argv[1]) + "/bench-" + std::to_string(1000000 + s).substr(1) + ".tar";
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) {
      std::perror(path.c_str());
      return 3;
    }
    const auto n = static_cast<std::size_t>(lseek(fd, 0, SEEK_END));
    if (n < per * kStride) {
      std::fprintf(stderr, "%s: %zu bytes, not the layout of loader_vs_torch.py --size 10240\n", path.c_str(), n);
      return 3;
    }
    fds.push_back(fd);
    sizes.push_back(n);
    maps.push_back(static_cast<const unsigned char*>(mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0)));
  }
  std::vector<std::pair<int, std::size_t>> in_order, shuffled;
  for (int s = 0; s < shards; ++s)
    for (std::size_t i = 0; i < per; ++i) in_order.emplace_back(s, 512 + i * kStride);
  shuffled = in_order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
  std::vector<unsigned char*> batches;
  for (int b = 0; b < 8; ++b) {
    auto* m = static_cast<unsigned char*>(std::aligned_alloc(4096, 1 << 20));
    std::memset(m, 1, 1 << 20);
    batches.push_back(m);
  }
  unsigned char* one = batches[0];
  auto copy_all = [&](const std::vector<std::pair<int, std::size_t>>& order, bool rotate, bool ahead) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      if (ahead && k + 1 < order.size()) prefetch_pages(maps[order[k + 1].first] + order[k + 1].second, kSpan);
      unsigned char* dst = rotate ? batches[(k / 64) % 8] + (k % 64) * kSpan : one;
      std::memcpy(dst, maps[order[k].first] + order[k].second, kSpan);
    }
  };
  auto remap = [&](int advice) {
    for (int s = 0; s < shards; ++s) {
      munmap(const_cast<unsigned char*>(maps[s]), sizes[s]);
      maps[s] = static_cast<const unsigned char*>(mmap(nullptr, sizes[s], PROT_READ, MAP_SHARED, fds[s], 0));
      if (advice) madvise(const_cast<unsigned char*>(maps[s]), sizes[s], advice);
    }
  };
  auto run = [&](const char* name, auto body) {
    for (int rep = 0; rep < 2; ++rep) body();
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      const double c0 = cpu_seconds();
      body();
      best = std::min(best, cpu_seconds() - c0);
    }
    std::printf("%-58s %.4f CPU s\n", name, best);
  };
  run("mapping, file order, one buffer", [&] { copy_all(in_order, false, false); });
  run("mapping, shuffled, one buffer", [&] { copy_all(shuffled, false, false); });
  run("mapping, shuffled, rotating batch buffers", [&] { copy_all(shuffled, true, false); });
  run("mapping, shuffled, batch buffers, next sample prefetched", [&] { copy_all(shuffled, true, true); });
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
  run("fresh mapping, shuffled, prefetched (map+fault+unmap)", [&] { remap(0); copy_all(shuffled, true, true); });
  run("fresh mapping + MADV_POPULATE_READ, shuffled, prefetched", [&] { remap(MADV_POPULATE_READ); copy_all(shuffled, true, true); });
  run("fresh mapping + MADV_HUGEPAGE, shuffled, prefetched", [&] { remap(MADV_HUGEPAGE); copy_all(shuffled, true, true); });
  run("pread per sample, shuffled, one buffer", [&] {
    for (auto& [s, o] : shuffled)
      if (pread(fds[s], one, kSpan, static_cast<off_t>(o)) != static_cast<ssize_t>(kSpan)) std::abort();
  });
  run("pread 128 KiB, file order, one buffer (cat)", [&] {
    for (int s = 0; s < shards; ++s)
      for (std::size_t o = 0; o < sizes[s]; o += 131072)
        if (pread(fds[s], one, 131072, static_cast<off_t>(o)) < 0) std::abort();
  });
#ifdef FLOOR_HAVE_URING
  io_uring ring;
  if (const int e = io_uring_queue_init(256, &ring, 0); e < 0) {
    std::printf("io_uring: not available here (%s)\n", std::strerror(-e));
    return 0;
  }
  // `per_submit` reads are queued, then one system call submits them and
  // waits for all: the kernel copies each span into its batch slot.
  auto uring_all = [&](std::size_t per_submit, bool registered) {
    for (std::size_t k = 0; k < shuffled.size(); k += per_submit) {
      const std::size_t m = std::min(per_submit, shuffled.size() - k);
      for (std::size_t j = 0; j < m; ++j) {
        const auto [s, o] = shuffled[k + j];
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        io_uring_prep_read(sqe, registered ? s : fds[s], batches[((k + j) / 64) % 8] + ((k + j) % 64) * kSpan, kSpan, o);
        if (registered) sqe->flags |= IOSQE_FIXED_FILE;
      }
      if (io_uring_submit_and_wait(&ring, static_cast<unsigned>(m)) < 0) std::abort();
      for (std::size_t j = 0; j < m; ++j) {
        io_uring_cqe* cqe = nullptr;
        if (io_uring_wait_cqe(&ring, &cqe) != 0 || cqe->res != static_cast<int>(kSpan)) std::abort();
        io_uring_cqe_seen(&ring, cqe);
      }
    }
  };
  run("io_uring, 64 reads per submit, shuffled, batch buffers", [&] { uring_all(64, false); });
  run("io_uring, 16 reads per submit, shuffled, batch buffers", [&] { uring_all(16, false); });
  if (io_uring_register_files(&ring, fds.data(), static_cast<unsigned>(fds.size())) == 0)
    run("io_uring, 64 per submit, registered files", [&] { uring_all(64, true); });
  io_uring_queue_exit(&ring);
#endif
  return 0;
}
