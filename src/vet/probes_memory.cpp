// Memory probes: host bandwidth (STREAM-style, all cores) and a pattern test.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstring>
#include <thread>

#include "pacer/core/stats.hpp"
#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

// Anonymous mapping, released on scope exit; pages are touched by the thread
// that will use them so they land on its NUMA node.
class Mapping {
 public:
  explicit Mapping(std::size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ptr_ = p == MAP_FAILED ? nullptr : p;
  }
  ~Mapping() {
    if (ptr_) ::munmap(ptr_, bytes_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
};

// Clones for the x86 vector widths; aarch64's NEON is in every core, so the
// plain -O3 loop already uses it.
#if defined(__x86_64__)
#define PACER_TRIAD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PACER_TRIAD_CLONES
#endif
PACER_TRIAD_CLONES
void triad(double* __restrict a, const double* __restrict b, const double* __restrict c, double s, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

std::size_t thread_count(const ProbeContext& ctx, const std::vector<int>& cpus) {
  const long long t = ctx.integer("threads");
  return t <= 0 ? cpus.size() : std::min<std::size_t>(static_cast<std::size_t>(t), cpus.size());
}

// Bytes counted as STREAM does: triad moves 3 words per element (read b and c,
// write a), copy 2 (read b, write a). Write-allocate traffic is not counted.
std::vector<Measurement> run_bandwidth(const ProbeContext& ctx) {
  const std::string pattern = ctx.params.at("pattern").get<std::string>();
  if (pattern != "triad" && pattern != "copy")
    return {not_measured("memory.bandwidth", CheckStatus::kError, fmt::format("unknown pattern '{}' (triad, copy)", pattern))};
  const int arrays = pattern == "triad" ? 3 : 2;
  const std::vector<int> cpus = hw::allowed_cpus();
  const std::size_t nthreads = thread_count(ctx, cpus);
  const std::size_t n = std::max<std::size_t>(ctx.bytes("size") / (8 * arrays), 1024 * nthreads);
  const long long reps = std::max<long long>(ctx.integer("reps"), 1);
  Mapping ma(n * 8), mb(n * 8), mc(arrays == 3 ? n * 8 : 8);
  if (!ma || !mb || !mc)
    return {not_measured("memory.bandwidth", CheckStatus::kError, fmt::format("cannot map {}", format_bytes(double(n) * 8 * arrays)))};
  double* a = ma.as<double>();
  double* b = mb.as<double>();
  double* c = mc.as<double>();

  std::vector<std::chrono::steady_clock::time_point> stamps;
  stamps.reserve(static_cast<std::size_t>(2 * (reps + 1) + 2));
  std::barrier sync(static_cast<std::ptrdiff_t>(nthreads), [&]() noexcept { stamps.push_back(std::chrono::steady_clock::now()); });
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      (void)hw::pin_current_thread(cpus[t]);
      const std::size_t lo = n * t / nthreads;
      const std::size_t hi = n * (t + 1) / nthreads;
      // Sources get non-zero data (never time on zeros), filled by copying a
      // small pattern block, which costs about one pass. The destination is
      // faulted in by the first pass; the median leaves that pass out.
      double pattern_b[1024];
      double pattern_c[1024];
      for (std::size_t k = 0; k < 1024; ++k) {
        pattern_b[k] = 1.0 + static_cast<double>(k) * 1e-3;
        pattern_c[k] = 2.0 - static_cast<double>(k % 512) * 1e-3;
      }
      for (std::size_t i = lo; i < hi; i += 1024) {
        const std::size_t n = std::min<std::size_t>(1024, hi - i);
        std::memcpy(b + i, pattern_b, n * 8);
        if (arrays == 3) std::memcpy(c + i, pattern_c, n * 8);
      }
      // The barrier's completion stamps the start and end of each pass.
      for (long long r = 0; r < reps && !cancelled(); ++r) {
        sync.arrive_and_wait();
        if (arrays == 3) triad(a + lo, b + lo, c + lo, 3.0, hi - lo);
        else std::memcpy(a + lo, b + lo, (hi - lo) * 8);
        sync.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
  if (cancelled()) return {};
  std::vector<double> gbps;
  const double bytes = static_cast<double>(n) * 8 * arrays;
  for (std::size_t p = 0; p + 1 < stamps.size(); p += 2) {
    const double s = std::chrono::duration<double>(stamps[p + 1] - stamps[p]).count();
    if (s > 0) gbps.push_back(bytes / s / 1e9);
  }
  // Read a result back so the stores cannot be dropped.
  const double check = a[n / 2];
  return {measured("memory.bandwidth", median(gbps),
                   fmt::format("{} over {} with {} threads, median of {} passes (best {:.1f}){}", pattern,
                               format_bytes(bytes), nthreads, gbps.size(), gbps.empty() ? 0.0 : *std::max_element(gbps.begin(), gbps.end()),
                               check == 0 ? " (no data?)" : ""))};
}

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Writes then verifies three patterns: each word's own address, its
// complement, and a pseudo-random stream. Catches stuck bits and address
// aliasing in the slice tested.
std::vector<Measurement> run_pattern(const ProbeContext& ctx) {
  const std::vector<int> cpus = hw::allowed_cpus();
  const std::size_t nthreads = thread_count(ctx, cpus);
  const std::size_t words = std::max<std::size_t>(ctx.bytes("size") / 8, 1024 * nthreads);
  Mapping m(words * 8);
  if (!m) return {not_measured("memory.pattern", CheckStatus::kError, fmt::format("cannot map {}", format_bytes(double(words) * 8)))};
  auto* w = m.as<std::uint64_t>();
  std::atomic<std::uint64_t> errors{0};
  std::atomic<std::uintptr_t> first_bad{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      (void)hw::pin_current_thread(cpus[t]);
      const std::size_t lo = words * t / nthreads;
      const std::size_t hi = words * (t + 1) / nthreads;
      auto expect = [&](int pass, std::size_t i) -> std::uint64_t {
        const auto addr = reinterpret_cast<std::uintptr_t>(&w[i]);
        if (pass == 0) return addr ^ 0x5a5a5a5a5a5a5a5aULL;
        if (pass == 1) return ~(addr ^ 0x5a5a5a5a5a5a5a5aULL);
        return mix(i + 0x9e3779b97f4a7c15ULL);
      };
      for (int pass = 0; pass < 3 && !cancelled(); ++pass) {
        for (std::size_t i = lo; i < hi; ++i) w[i] = expect(pass, i);
        std::uint64_t bad = 0;
        for (std::size_t i = lo; i < hi; ++i) {
          if (w[i] != expect(pass, i)) {
            if (bad++ == 0) {
              std::uintptr_t zero = 0;
              first_bad.compare_exchange_strong(zero, reinterpret_cast<std::uintptr_t>(&w[i]));
            }
          }
        }
        errors += bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  if (cancelled()) return {};
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double gbps = 6.0 * static_cast<double>(words) * 8 / secs / 1e9;
  std::string detail = fmt::format("3 patterns over {} ({:.1f} GB/s written and verified)", format_bytes(double(words) * 8), gbps);
  if (errors) detail += fmt::format("; first bad word at {:#x}", first_bad.load());
  return {measured("memory.pattern", static_cast<double>(errors.load()), detail)};
}

}  // namespace

std::vector<ProbeSpec> memory_probes() {
  std::vector<ProbeSpec> v;
  v.push_back({"memory.bandwidth",
               {{"memory.bandwidth", "memory", "GB/s", ValueKind::kNumber, Direction::kHigher,
                 "host memory bandwidth, STREAM triad on all allowed CPUs (median pass)"}},
               {{"size", ParamType::kSize, "1GiB", "256MiB", "total size of the arrays"},
                {"threads", ParamType::kInteger, 0, 0, "threads (0: one per allowed CPU)"},
                {"reps", ParamType::kInteger, 10, 5, "timed passes"},
                {"pattern", ParamType::kString, "triad", "triad", "triad (a = b + s*c) or copy (memcpy)"}},
               "", false, 60, 10, run_bandwidth});
  v.push_back({"memory.pattern",
               {{"memory.pattern", "memory", "errors", ValueKind::kNumber, Direction::kNone,
                 "words that read back wrong in an address, inverse-address and random pattern test"}},
               {{"size", ParamType::kSize, "1GiB", "128MiB", "memory tested"},
                {"threads", ParamType::kInteger, 0, 0, "threads (0: one per allowed CPU)"}},
               "", false, 60, 10, run_pattern});
  return v;
}

}  // namespace pacer::vet
