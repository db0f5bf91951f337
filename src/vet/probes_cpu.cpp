// CPU probe: sustained double-precision FLOP/s on every allowed core at once.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <thread>

#include "pacer/core/stats.hpp"
#include "pacer/hw/system.hpp"
#include "probes.hpp"

#if defined(__aarch64__)
#include <arm_sve.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace pacer::vet {
namespace {

// Independent multiply-add chains, enough of them to keep every FMA port busy
// through its latency; the vector width follows the instruction set. The
// multiplier below 1 keeps the values bounded (no overflow, no denormals).
// Each element operation is counted as 2 FLOPs, fused or not.
// ATTRS are function attributes: the x86 kernels are compiled for
// instruction sets the rest of the binary does not assume.
#define PACER_FLOP_KERNEL(NAME, ATTRS, BYTES, CHAINS)                                       \
  __attribute__((ATTRS, noinline)) double NAME(std::uint64_t iters, double seed) {          \
    typedef double vec __attribute__((vector_size(BYTES)));                                 \
    constexpr int kLanes = BYTES / 8;                                                       \
    vec acc[CHAINS];                                                                        \
    vec mul, add;                                                                           \
    for (int l = 0; l < kLanes; ++l) {                                                      \
      mul[l] = 0.999999;                                                                    \
      add[l] = 1e-6 * seed;                                                                 \
    }                                                                                       \
    for (int c = 0; c < CHAINS; ++c)                                                        \
      for (int l = 0; l < kLanes; ++l) acc[c][l] = seed + c + 0.1 * l;                      \
    for (std::uint64_t i = 0; i < iters; ++i) {                                             \
      for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * mul + add;                         \
    }                                                                                       \
    double s = 0;                                                                           \
    for (int c = 0; c < CHAINS; ++c)                                                        \
      for (int l = 0; l < kLanes; ++l) s += acc[c][l];                                      \
    return s;                                                                               \
  }

struct Kernel {
  double (*fn)(std::uint64_t, double);
  double flops_per_iter;
  const char* isa;
};

#if defined(__x86_64__) || defined(__i386__)
PACER_FLOP_KERNEL(flops_avx512, target("avx512f,fma"), 64, 12)
PACER_FLOP_KERNEL(flops_avx2, target("avx2,fma"), 32, 10)
PACER_FLOP_KERNEL(flops_sse2, target("sse2"), 16, 8)

Kernel pick_kernel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return {flops_avx512, 12 * 8 * 2, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {flops_avx2, 10 * 4 * 2, "avx2"};
  return {flops_sse2, 8 * 2 * 2, "sse2"};
}
#elif defined(__aarch64__)
// NEON (Advanced SIMD) is in every ARMv8-A core, so it needs no attribute:
// 128-bit registers, two doubles, FMLA. 16 chains cover four FMA pipes of
// four-cycle latency (Neoverse V2, Grace's core).
PACER_FLOP_KERNEL(flops_neon, , 16, 16)

#if defined(__ARM_FEATURE_SVE) || (defined(__GNUC__) && __GNUC__ >= 10)
#define PACER_HAVE_SVE_KERNEL 1
// SVE registers are as wide as the hardware makes them (128 to 2048 bits),
// so one kernel fits all; sizeless types cannot form arrays, hence the names.
__attribute__((target("+sve"), noinline)) double flops_sve(std::uint64_t iters, double seed) {
  const svbool_t all = svptrue_b64();
  const svfloat64_t mul = svdup_f64(0.999999), add = svdup_f64(1e-6 * seed);
#define PACER_SVE_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define PACER_SVE_INIT(c) svfloat64_t a##c = svdup_f64(seed + c);
#define PACER_SVE_STEP(c) a##c = svmla_f64_x(all, add, a##c, mul);
#define PACER_SVE_SUM(c) s += svaddv_f64(all, a##c);
  PACER_SVE_CHAINS(PACER_SVE_INIT)
  for (std::uint64_t i = 0; i < iters; ++i) {
    PACER_SVE_CHAINS(PACER_SVE_STEP)
  }
  double s = 0;
  PACER_SVE_CHAINS(PACER_SVE_SUM)
  return s;
}
__attribute__((target("+sve"))) double sve_doubles() { return static_cast<double>(svcntd()); }
#endif

Kernel pick_kernel() {
#ifdef PACER_HAVE_SVE_KERNEL
  // Where SVE is no wider than NEON (Grace's Neoverse V2: 128 bits) the two
  // are equal; SVE wins only on wider vectors.
  if (::getauxval(AT_HWCAP) & HWCAP_SVE) {
    const double lanes = sve_doubles();
    if (lanes > 2) return {flops_sve, 16 * lanes * 2, "sve"};
  }
#endif
  return {flops_neon, 16 * 2 * 2, "neon"};
}
#else
// Whatever vectors the compiler makes of 16 bytes on this architecture.
PACER_FLOP_KERNEL(flops_generic, , 16, 8)
Kernel pick_kernel() { return {flops_generic, 8 * 2 * 2, "generic"}; }
#endif

std::vector<Measurement> run_cpu(const ProbeContext& ctx) {
  const double duration = ctx.seconds("duration");
  const Kernel k = pick_kernel();
  const std::vector<int> cpus = hw::allowed_cpus();
  const std::size_t n = cpus.size();
  std::vector<double> rate(n, 0);
  std::vector<double> sink(n, 0);
  std::barrier start(static_cast<std::ptrdiff_t>(n));
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      (void)hw::pin_current_thread(cpus[t]);
      k.fn(1000, 1.0);  // warm up the core's clocks and the code path
      start.arrive_and_wait();
      const auto t0 = std::chrono::steady_clock::now();
      std::uint64_t iters = 0;
      double elapsed = 0;
      double s = 0;
      const std::uint64_t chunk = 200'000;
      while (elapsed < duration && !cancelled()) {
        s += k.fn(chunk, 1.0 + static_cast<double>(t));
        iters += chunk;
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      sink[t] = s;
      rate[t] = elapsed > 0 ? static_cast<double>(iters) * k.flops_per_iter / elapsed / 1e9 : 0;
    });
  }
  for (auto& th : threads) th.join();
  double total = 0;
  std::size_t slowest = 0;
  for (std::size_t t = 0; t < n; ++t) {
    total += rate[t];
    if (rate[t] < rate[slowest]) slowest = t;
  }
  const double med = median(rate);
  const double checksum = sink[0];
  std::vector<Measurement> out;
  out.push_back(measured("cpu.flops", total,
                         fmt::format("fp64 {} on {} CPUs for {:.1f} s ({:.1f} GFLOP/s per CPU, median)", k.isa, n, duration, med)));
  out.push_back(measured("cpu.flops_per_core", rate[slowest],
                         fmt::format("slowest is cpu {}; median {:.1f} GFLOP/s", cpus[slowest], med)));
  out.push_back(measured("cpu.core_balance", med > 0 ? 100.0 * rate[slowest] / med : 0,
                         fmt::format("slowest cpu {} against the median of {} CPUs{}", cpus[slowest], n,
                                     checksum == 0 ? " (checksum 0?)" : "")));
  return out;
}

}  // namespace

std::vector<ProbeSpec> cpu_probes() {
  return {{"cpu",
           {{"cpu.flops", "cpu", "GFLOP/s", ValueKind::kNumber, Direction::kHigher,
             "sustained fp64 FLOP/s, all allowed CPUs at once"},
            {"cpu.flops_per_core", "cpu", "GFLOP/s", ValueKind::kNumber, Direction::kHigher,
             "the slowest CPU's FLOP/s while all run"},
            {"cpu.core_balance", "cpu", "%", ValueKind::kNumber, Direction::kNone,
             "slowest CPU as a percentage of the median CPU (a throttled socket or a busy core)"}},
           {{"duration", ParamType::kDuration, "3s", "1s", "how long every CPU runs the kernel"}},
           "", false, 30, 10, run_cpu}};
}

}  // namespace pacer::vet
