// System probes: THP, memory headroom, swap, file limits, foreign load, clock source.
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

std::vector<Measurement> run_thp(const ProbeContext&) {
  auto thp = hw::read_thp();
  if (!thp) {
    return {not_measured("system.thp_enabled", CheckStatus::kSkip, "kernel has no transparent huge pages: " + thp.error().message),
            not_measured("system.thp_defrag", CheckStatus::kSkip, "kernel has no transparent huge pages")};
  }
  return {measured_text("system.thp_enabled", thp->enabled, "/sys/kernel/mm/transparent_hugepage/enabled"),
          measured_text("system.thp_defrag", thp->defrag, "/sys/kernel/mm/transparent_hugepage/defrag")};
}

std::vector<Measurement> run_memory_state(const ProbeContext&) {
  auto mi = hw::read_meminfo();
  if (!mi) {
    return {not_measured("system.mem_available", CheckStatus::kError, mi.error().message),
            not_measured("system.swap_used", CheckStatus::kError, mi.error().message)};
  }
  const double pct = mi->total ? 100.0 * static_cast<double>(mi->available) / static_cast<double>(mi->total) : 0;
  const double swap_used = static_cast<double>(mi->swap_total - mi->swap_free);
  return {measured("system.mem_available", pct,
                   fmt::format("{} available of {}", format_bytes(static_cast<double>(mi->available)), format_bytes(static_cast<double>(mi->total)))),
          measured("system.swap_used", swap_used / 1048576.0,
                   mi->swap_total ? fmt::format("{} swap configured", format_bytes(static_cast<double>(mi->swap_total))) : "no swap configured")};
}

std::vector<Measurement> run_nofile(const ProbeContext&) {
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const auto text = [](rlim_t v) { return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v); };
  return {measured("system.nofile", rl.rlim_cur == RLIM_INFINITY ? 1e12 : static_cast<double>(rl.rlim_cur),
                   fmt::format("soft limit {}, hard limit {}", text(rl.rlim_cur), text(rl.rlim_max)))};
}

// CPU time used by other processes over a short window while this one sleeps:
// what a training job would have to share the node with.
std::vector<Measurement> run_load(const ProbeContext& ctx) {
  const double window = ctx.seconds("window");
  auto a = hw::read_cpu_times();
  const double self_a = hw::process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::duration<double>(window));
  auto b = hw::read_cpu_times();
  const double self_b = hw::process_cpu_seconds();
  if (!a || !b) return {not_measured("system.load", CheckStatus::kError, (a ? b : a).error().message)};
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double total = static_cast<double>(b->total - a->total);
  double busy = static_cast<double>(b->busy - a->busy) - (self_b - self_a) * ticks;
  if (busy < 0) busy = 0;
  const double pct = total > 0 ? 100.0 * busy / total : 0;
  const long ncpu = ::sysconf(_SC_NPROCESSORS_ONLN);
  return {measured("system.load", pct,
                   fmt::format("{:.0f}% of {} CPUs busy with other processes over {}", pct, ncpu, format_duration(window)))};
}

std::vector<Measurement> run_clocksource(const ProbeContext&) {
  auto cs = hw::read_clocksource();
  if (!cs) return {not_measured("system.clocksource", CheckStatus::kSkip, cs.error().message)};
  return {measured_text("system.clocksource", *cs, "a slow clock source makes every timer call (and NCCL's) expensive")};
}

}  // namespace

std::vector<ProbeSpec> system_probes() {
  std::vector<ProbeSpec> v;
  v.push_back({"system.thp",
               {{"system.thp_enabled", "system", "", ValueKind::kText, Direction::kNone,
                 "transparent huge pages mode (always, madvise, never)"},
                {"system.thp_defrag", "system", "", ValueKind::kText, Direction::kNone,
                 "THP defragmentation mode; 'always' stalls allocations"}},
               {}, "", false, 5, 5, run_thp});
  v.push_back({"system.memory",
               {{"system.mem_available", "system", "%", ValueKind::kNumber, Direction::kHigher,
                 "memory available to a new job (MemAvailable / MemTotal)"},
                {"system.swap_used", "system", "MiB", ValueKind::kNumber, Direction::kNone,
                 "swap in use: memory pressure from other tenants or leftovers"}},
               {}, "", false, 5, 5, run_memory_state});
  v.push_back({"system.nofile",
               {{"system.nofile", "system", "files", ValueKind::kNumber, Direction::kNone,
                 "open-file soft limit (data loader workers and NCCL need many)"}},
               {}, "", false, 5, 5, run_nofile});
  v.push_back({"system.load",
               {{"system.load", "system", "%", ValueKind::kNumber, Direction::kNone,
                 "CPU busy with other processes over a short window"}},
               {{"window", ParamType::kDuration, "1s", "500ms", "how long to watch /proc/stat"}},
               "", false, 10, 5, run_load});
  v.push_back({"system.clocksource",
               {{"system.clocksource", "system", "", ValueKind::kText, Direction::kNone, "kernel clock source"}},
               {}, "", false, 5, 5, run_clocksource});
  return v;
}

}  // namespace pacer::vet
