#include "pacer/telemetry/sampler.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace pacer::telemetry {

namespace {
const MetricDef* def(std::string_view name) {
  const MetricDef* d = find_metric(name);
  if (!d) throw std::logic_error(fmt::format("telemetry: metric '{}' is not in metric_defs()", name));
  return d;
}
}  // namespace

Sampler::Sampler(SamplerOptions options) : opt_(std::move(options)), threads_(opt_.root) {
  node_.hostname = hw::hostname();
  node_.kernel = hw::kernel_release();
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  node_.cpus = cpus > 0 ? static_cast<unsigned>(cpus) : 0;
  if (auto m = hw::read_meminfo(opt_.root)) node_.memory_bytes = m->total;
  if (!opt_.gpus) return;
  if (!opt_.nvml) {
    auto nvml = hw::Nvml::open();
    if (!nvml) {
      note(nvml.error().message + "; GPU metrics skipped");
      return;
    }
    opt_.nvml = *nvml;
  }
  auto count = opt_.nvml->device_count();
  if (!count) {
    note(count.error().message + "; GPU metrics skipped");
    return;
  }
  for (unsigned i = 0; i < *count; ++i) {
    GpuRecord g;
    g.index = i;
    if (auto info = opt_.nvml->query(i)) {
      g.uuid = info->uuid;
      g.name = info->name;
      g.memory_bytes = info->memory_total.value_or(0);
    }
    gpus_.push_back(g);
    auto gpm = hw::GpmSampler::open(opt_.nvml, i);
    if (!gpm) note(gpm.error().message + "; GPM metrics skipped for this GPU");
    gpm_.push_back(gpm ? std::move(*gpm) : nullptr);
  }
  last_reasons_.assign(gpus_.size(), 0);
}

Sampler::~Sampler() = default;

void Sampler::note(const std::string& text) {
  if (std::find(notes_.begin(), notes_.end(), text) == notes_.end()) notes_.push_back(text);
}

void Sampler::counter(Sample& s, const MetricDef* d, int gpu, const std::string& device, double total) {
  const std::string key = fmt::format("{}|{}|{}", d->name, gpu, device);
  auto it = prev_totals_.find(key);
  // The rate is over the time since this counter was last read, which is not
  // the pass interval for counters read every few seconds. A counter that went
  // backwards was reset (driver reload, interface re-created) and a clock that
  // did not advance gives no interval: both are dropped, never reported as a
  // negative or infinite rate.
  if (it != prev_totals_.end()) {
    const double dt = s.t - it->second.first;
    if (dt > 0 && total >= it->second.second && std::isfinite(total))
      s.readings.push_back({d, gpu, device, (total - it->second.second) / dt, total});
  }
  prev_totals_[key] = {s.t, total};
}

bool Sampler::due(double& last, double every, bool force) {
  // Slack of 5% (at most 50 ms): passes `every` apart arrive a little early
  // or late, and a read due every second must not slip to every other pass
  // at 1 Hz. A wall clock stepped backwards must not postpone the read until
  // it catches up.
  const double slack = std::min(0.05 * every, 0.05);
  if (force || now_ - last >= every - slack || now_ < last) {
    last = now_;
    return true;
  }
  return false;
}

bool Sampler::root_alive() const {
  auto text = hw::read_text(fmt::format("{}/proc/{}/stat", opt_.root, opt_.pid));
  if (!text) return false;
  auto st = hw::parse_pid_stat(*text);
  return st && st->state != 'Z';
}

Sample Sampler::sample(double now, double self_cpu_s) {
  Sample s;
  s.t = now;
  s.interval_s = prev_t_ > 0 ? now - prev_t_ : 0;
  now_ = now;
  sample_host(s);
  sample_gpus(s);
  if (self_cpu_s >= 0) counter(s, def("sampler.cpu_seconds"), -1, "", self_cpu_s);
  prev_t_ = now;
  return s;
}

void Sampler::sample_host(Sample& s) {
  if (auto cpu = hw::read_cpu_stat(opt_.root)) {
    if (have_prev_cpu_) {
      const auto busy = [](const hw::CpuTimes& a, const hw::CpuTimes& b) -> std::optional<double> {
        if (b.total <= a.total || b.busy < a.busy) return std::nullopt;
        return static_cast<double>(b.busy - a.busy) / static_cast<double>(b.total - a.total);
      };
      static const MetricDef* kBusy = def("cpu.busy");
      if (auto v = busy(prev_cpu_.total, cpu->total)) s.readings.push_back({kBusy, -1, "", *v, {}});
      if (opt_.per_core) {
        for (const auto& c : cpu->cores) {
          auto p = std::find_if(prev_cpu_.cores.begin(), prev_cpu_.cores.end(),
                                [&](const hw::CoreTimes& x) { return x.cpu == c.cpu; });
          if (p == prev_cpu_.cores.end()) continue;
          if (auto v = busy(p->times, c.times)) s.readings.push_back({kBusy, -1, fmt::format("cpu{}", c.cpu), *v, {}});
        }
      }
    }
    prev_cpu_ = std::move(*cpu);
    have_prev_cpu_ = true;
  } else {
    note(cpu.error().message);
  }
  if (auto m = hw::read_meminfo(opt_.root)) {
    s.readings.push_back({def("mem.used_bytes"), -1, "", static_cast<double>(m->total - m->available), {}});
    s.readings.push_back({def("mem.available_bytes"), -1, "", static_cast<double>(m->available), {}});
  } else {
    note(m.error().message);
  }
  if (opt_.pid > 0 && process_alive_) {
    // Listing the tree reads every process on the node; it is redone at most
    // once a second (new children show up within a second), while the tree's
    // own counters are read every pass.
    if (tree_pids_.empty() || now_ - last_tree_scan_ >= kTreeScanEverySeconds) {
      auto pids = hw::process_tree_pids(opt_.pid, opt_.root);
      tree_pids_ = pids ? std::move(*pids) : std::vector<int>{};
      last_tree_scan_ = now_;
    }
    auto t = tree_pids_.empty() ? Expected<hw::ProcessTreeStat>(Error{ErrorKind::kIo, "gone"})
                                : hw::read_processes(opt_.pid, tree_pids_, opt_.root);
    // The root itself gone (or a zombie) ends the following.
    if (t && (t->processes == 0 || !root_alive())) t = Error{ErrorKind::kIo, "gone"};
    if (t) {
      counter(s, def("proc.cpu_seconds"), -1, "", t->cpu_seconds);
      s.readings.push_back({def("proc.rss_bytes"), -1, "", static_cast<double>(t->rss_bytes), {}});
      s.readings.push_back({def("proc.count"), -1, "", static_cast<double>(t->processes), {}});
      // Every thread's stat costs ~10 us; once a second keeps a 10 Hz
      // monitor cheap, and 10 ms clock ticks over a second give a share to 1%.
      if (opt_.threads && due(last_threads_, kThreadsEverySeconds)) s.busiest_thread = threads_.sample(tree_pids_, now_);
      if (t->io_readable) {
        counter(s, def("proc.read_bytes"), -1, "", static_cast<double>(t->io.read_bytes));
        counter(s, def("proc.write_bytes"), -1, "", static_cast<double>(t->io.write_bytes));
      } else {
        note(fmt::format("/proc/PID/io of process {} or a child is not readable; process I/O skipped", opt_.pid));
      }
    } else {
      process_alive_ = false;
    }
  }
  if (auto net = hw::read_net_dev(opt_.root)) {
    for (const auto& n : *net) {
      if (n.name == "lo") continue;
      counter(s, def("net.rx_bytes"), -1, n.name, static_cast<double>(n.rx_bytes));
      counter(s, def("net.tx_bytes"), -1, n.name, static_cast<double>(n.tx_bytes));
    }
  } else {
    note(net.error().message);
  }
  for (const auto& ib : hw::read_ib_counters(opt_.root)) {
    const std::string dev = fmt::format("{}:{}", ib.device, ib.port);
    counter(s, def("ib.rx_bytes"), -1, dev, static_cast<double>(ib.rx_bytes));
    counter(s, def("ib.tx_bytes"), -1, dev, static_cast<double>(ib.tx_bytes));
    counter(s, def("ib.errors"), -1, dev, static_cast<double>(ib.symbol_errors + ib.rcv_errors + ib.link_downed));
  }
  if (auto disks = hw::read_diskstats(opt_.root)) {
    for (const auto& d : *disks) {
      // Loop and RAM devices say nothing about storage; partitions repeat their disk.
      if (d.name.rfind("loop", 0) == 0 || d.name.rfind("ram", 0) == 0) continue;
      if (d.reads == 0 && d.writes == 0) continue;
      counter(s, def("disk.read_bytes"), -1, d.name, static_cast<double>(d.read_bytes));
      counter(s, def("disk.write_bytes"), -1, d.name, static_cast<double>(d.write_bytes));
      counter(s, def("disk.io_seconds"), -1, d.name, static_cast<double>(d.io_ms) / 1000.0);
    }
  }
}

void Sampler::sample_gpus(Sample& s) {
  if (!opt_.nvml) return;
  // The schedule (docs/telemetry.md, "Sampling schedule"): what moves within a
  // second is read every pass, temperature and memory clock every second, the
  // process list and the energy counter every kSlowQueryEverySeconds, ECC, row
  // remaps and the PCIe link every kFullQueryEverySeconds. GPM is sampled at
  // most every kGpmEverySeconds: its figures are averages between two samples,
  // a shorter window only costs more (its metric computation is the costliest
  // call), and over a few milliseconds NVML returns NaN for some of them.
  using Scope = hw::Nvml::QueryScope;
  const bool full = due(last_full_query_, kFullQueryEverySeconds);
  const bool slow = due(last_slow_query_, kSlowQueryEverySeconds, full);
  const bool per_second = due(last_per_second_query_, 1, slow);
  const bool gpm = due(last_gpm_, kGpmEverySeconds);
  const Scope scope = full ? Scope::kAll : slow ? Scope::kDynamic : per_second ? Scope::kPerSecond : Scope::kFast;
  for (std::size_t i = 0; i < gpus_.size(); ++i) {
    const int gi = static_cast<int>(i);
    auto info = opt_.nvml->query(static_cast<unsigned>(i), scope);
    if (!info) {
      note(info.error().message);
      continue;
    }
    const auto gauge = [&](const char* name, auto v, double scale = 1.0) {
      if (v) s.readings.push_back({def(name), gi, "", static_cast<double>(*v) * scale, {}});
    };
    gauge("gpu.util", info->utilization_gpu_pct, 0.01);
    gauge("gpu.mem_util", info->utilization_memory_pct, 0.01);
    gauge("gpu.memory_used_bytes", info->memory_used);
    gauge("gpu.temperature_c", info->temperature_c);
    gauge("gpu.power_w", info->power_mw, 0.001);
    gauge("gpu.sm_clock_hz", info->sm_clock_mhz, 1e6);
    gauge("gpu.mem_clock_hz", info->mem_clock_mhz, 1e6);
    gauge("gpu.clock_event_reasons", info->clock_event_reasons);
    gauge("gpu.ecc_uncorrected", info->ecc_volatile_uncorrected);
    gauge("gpu.remapped_rows", info->remapped_rows_uncorrectable);
    gauge("gpu.remap_pending", info->remap_pending);
    gauge("gpu.processes", info->compute_processes);
    if (info->energy_mj) counter(s, def("gpu.energy_j"), gi, "", static_cast<double>(*info->energy_mj) / 1000.0);
    if (info->compute_processes.value_or(0) > 0) {
      if (auto procs = opt_.nvml->compute_processes(static_cast<unsigned>(i))) {
        for (const auto& p : *procs)
          if (p.used_memory)
            s.readings.push_back({def("gpu.process_memory_bytes"), gi, fmt::format("pid {}", p.pid),
                                  static_cast<double>(*p.used_memory), {}});
      } else {
        note(procs.error().message);
      }
    }
    // Throttling starts and ends become events so that a query can find them
    // without scanning every sample.
    const std::uint64_t now_bits = info->clock_event_reasons.value_or(0) & kThrottleReasons;
    const std::uint64_t old_bits = last_reasons_[i] & kThrottleReasons;
    if (now_bits != old_bits) {
      s.events.push_back({now_, now_bits ? "gpu.throttle" : "gpu.throttle_end",
                          hw::clock_event_names(now_bits ? now_bits : old_bits), gi, -1});
    }
    last_reasons_[i] = info->clock_event_reasons.value_or(0);
    if (gpm && gpm_[i]) {
      auto m = gpm_[i]->sample();
      if (!m) {
        note(m.error().message + "; GPM metrics skipped for this GPU");
        gpm_[i].reset();
      } else if (*m) {
        const hw::GpmMetrics& g = **m;
        gauge("gpm.sm_util", g.sm_util);
        gauge("gpm.sm_occupancy", g.sm_occupancy);
        gauge("gpm.tensor_util", g.tensor_util);
        gauge("gpm.dram_bw_util", g.dram_bw_util);
        gauge("gpm.fp64_util", g.fp64_util);
        gauge("gpm.fp32_util", g.fp32_util);
        gauge("gpm.fp16_util", g.fp16_util);
        gauge("gpm.pcie_tx_bytes_per_s", g.pcie_tx_bytes_per_s);
        gauge("gpm.pcie_rx_bytes_per_s", g.pcie_rx_bytes_per_s);
        gauge("gpm.nvlink_tx_bytes_per_s", g.nvlink_tx_bytes_per_s);
        gauge("gpm.nvlink_rx_bytes_per_s", g.nvlink_rx_bytes_per_s);
      }
    }
  }
}

}  // namespace pacer::telemetry
