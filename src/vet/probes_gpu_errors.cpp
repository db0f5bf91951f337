// GPU error probes: Xid reports (kernel log since boot, NVML events during vet), retired pages, NVLink state and
// error counters with their rise, and the GPUs' NUMA affinity to the CPUs and the RDMA NICs.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "pacer/hw/gpu_errors.hpp"
#include "pacer/hw/nvml.hpp"
#include "probes.hpp"

namespace pacer::vet {

std::string vet_root() {
  const char* r = std::getenv("PACER_VET_ROOT");
  return r ? r : "";
}

namespace {

constexpr const char* kErrorChecks[] = {"gpu.xid",           "gpu.xid_new",      "gpu.retired_pages", "gpu.nvlink_down",
                                        "gpu.nvlink_active", "gpu.nvlink_crc",   "gpu.nvlink_replay", "gpu.nvlink_recovery",
                                        "gpu.nvlink_rise"};
constexpr const char* kTopologyChecks[] = {"gpu.numa_node", "gpu.nic_numa"};

template <std::size_t N>
std::vector<Measurement> skip_each(const char* const (&checks)[N], const std::string& why, CheckStatus s = CheckStatus::kSkip) {
  std::vector<Measurement> out;
  for (const char* c : checks) out.push_back(not_measured(c, s, why));
  return out;
}

// "0,0,1,1" from a profile parameter; anything but integers is an error naming the key.
Expected<std::vector<long long>> parse_list(const std::string& key, const std::string& s) {
  std::vector<long long> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) continue;
    long long v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc{} || end != item.data() + item.size())
      return Error{ErrorKind::kConfig, fmt::format("profile parameter {}: '{}' is not an integer (in \"{}\")", key, item, s)};
    out.push_back(v);
  }
  return out;
}

// "Xid 79 (GPU has fallen off the bus.)" for the last few of a GPU's reports.
std::string describe(const std::vector<hw::KernelXid>& xids) {
  std::string s;
  const std::size_t from = xids.size() > 3 ? xids.size() - 3 : 0;
  for (std::size_t i = from; i < xids.size(); ++i) {
    std::string msg = xids[i].message.substr(0, 60);
    s += fmt::format("{}Xid {}{}", s.empty() ? "" : "; ", xids[i].xid, msg.empty() ? "" : " (" + msg + ")");
  }
  return s;
}

// Sums over a GPU's links, and for each counter the link with the most.
struct Counter {
  bool reported = false;
  std::uint64_t total = 0, most = 0;
  unsigned worst_link = 0;
  void add(unsigned link, const std::optional<std::uint64_t>& v) {
    if (!v) return;
    reported = true;
    total += *v;
    if (*v > most) most = *v, worst_link = link;
  }
};
struct LinkTotals {
  unsigned links = 0, active = 0;
  Counter crc, replay, recovery;
  std::vector<unsigned> down;
};
LinkTotals totals(const std::vector<hw::NvLink>& links) {
  LinkTotals t;
  for (const auto& l : links) {
    ++t.links;
    if (l.active) ++t.active;
    else t.down.push_back(l.link);
    t.crc.add(l.link, l.crc);
    t.replay.add(l.link, l.replay);
    t.recovery.add(l.link, l.recovery);
  }
  return t;
}

// The GPU count, or (in `why`) the measurements that say why there are no GPUs to look at.
template <std::size_t N>
unsigned visible_gpus(const Expected<std::shared_ptr<hw::Nvml>>& nvml, const char* const (&checks)[N], std::vector<Measurement>* why) {
  if (!nvml) return *why = skip_each(checks, nvml.error().message), 0;
  auto count = (*nvml)->device_count();
  if (!count) return *why = skip_each(checks, count.error().message, CheckStatus::kError), 0;
  if (*count == 0) *why = skip_each(checks, "NVIDIA driver loaded but no GPU visible");
  return *count;
}

std::vector<Measurement> run_gpu_errors(const ProbeContext& ctx) {
  auto nvml = hw::Nvml::open();
  std::vector<Measurement> none;
  const unsigned n = visible_gpus(nvml, kErrorChecks, &none);
  if (n == 0) return none;
  auto critical_list = parse_list("critical_xids", ctx.params.at("critical_xids").get<std::string>());
  if (!critical_list) return skip_each(kErrorChecks, critical_list.error().message, CheckStatus::kError);
  const std::set<long long> critical(critical_list->begin(), critical_list->end());
  std::vector<std::string> pci(n);
  for (unsigned i = 0; i < n; ++i) pci[i] = (*nvml)->pci_bus_id(i);

  // First NVLink reading; the second follows the event watch, and the
  // difference is the rise while this probe waited.
  std::vector<Expected<std::vector<hw::NvLink>>> before;
  for (unsigned i = 0; i < n; ++i) before.push_back((*nvml)->nvlinks(i));
  auto events = (*nvml)->watch_xid(ctx.seconds("watch"));
  const double watched = ctx.seconds("watch");
  const std::string root = vet_root();
  auto kernel = hw::read_kernel_xids(root);

  // Kernel reports by GPU, matched on the PCI address; reports of a GPU NVML
  // no longer lists (one that fell off the bus) are kept under their address.
  std::map<std::string, unsigned> gpu_of_pci;
  for (unsigned i = 0; i < n; ++i)
    if (pci[i].size() > 3) gpu_of_pci[pci[i].substr(0, pci[i].size() - 2)] = i;  // drop the ".0" function
  std::vector<std::vector<hw::KernelXid>> boot(n), during(n);
  std::map<std::string, std::vector<hw::KernelXid>> orphans;
  if (kernel) {
    for (const auto& x : *kernel) {
      const auto g = gpu_of_pci.find(x.pci);
      if (g == gpu_of_pci.end()) {
        orphans[x.pci].push_back(x);
        continue;
      }
      boot[g->second].push_back(x);
      if (x.time_s && *x.time_s >= ctx.vet_started_s) during[g->second].push_back(x);
    }
  }
  std::vector<std::vector<unsigned long long>> nvml_events(n);
  if (events)
    for (const auto& e : *events)
      if (e.gpu < n) nvml_events[e.gpu].push_back(e.xid);

  std::vector<Measurement> out;
  auto critical_in = [&](const std::vector<hw::KernelXid>& xs) -> const hw::KernelXid* {
    for (auto it = xs.rbegin(); it != xs.rend(); ++it)
      if (critical.count(it->xid)) return &*it;
    return nullptr;
  };
  for (unsigned i = 0; i < n; ++i) {
    const std::string target = fmt::format("gpu{}", i);
    // gpu.xid: since boot, from the kernel log.
    if (!kernel) {
      out.push_back(not_measured("gpu.xid", CheckStatus::kSkip, "kernel log not readable: " + kernel.error().message, target));
    } else {
      Measurement m = measured("gpu.xid", static_cast<double>(boot[i].size()),
                               boot[i].empty() ? fmt::format("no Xid in the kernel log for {}", pci[i]) : describe(boot[i]), target);
      if (const auto* c = critical_in(boot[i])) {
        m.status = CheckStatus::kFail;
        m.reason = fmt::format("Xid {} since boot ({}): the GPU needs a reset or service", c->xid, c->message.substr(0, 80));
      }
      out.push_back(m);
    }
    // gpu.xid_new: raised during this vet, by the kernel log's clock or NVML's events.
    const std::size_t from_log = during[i].size();
    const std::size_t from_nvml = nvml_events[i].size();
    if (!kernel && !events) {
      out.push_back(not_measured("gpu.xid_new", CheckStatus::kSkip,
                                 fmt::format("kernel log not readable and {}", events.error().message), target));
    } else {
      std::string how = kernel ? "kernel log since vet began" : "";
      if (events) how += fmt::format("{}NVML events over {:.0f} s", how.empty() ? "" : ", ", watched);
      std::string seen;
      for (auto x : nvml_events[i]) seen += fmt::format("{}{}", seen.empty() ? "" : ",", x);
      Measurement m = measured("gpu.xid_new", static_cast<double>(std::max(from_log, from_nvml)),
                               seen.empty() && during[i].empty() ? how : fmt::format("{}; Xid {}", how, seen.empty() ? describe(during[i]) : seen),
                               target);
      out.push_back(m);
    }
    // Retired pages: GPUs before Ampere; later ones remap rows (gpu.remap).
    if (auto rp = (*nvml)->retired_pages(i)) {
      Measurement m = measured("gpu.retired_pages", rp->single_bit + rp->double_bit,
                               fmt::format("{} for double-bit, {} for repeated single-bit errors", rp->double_bit, rp->single_bit), target);
      if (rp->pending) {
        m.status = CheckStatus::kFail;
        m.reason = "a page retirement is pending: reload the driver (or reset the GPU) before use";
      }
      out.push_back(m);
    } else {
      out.push_back(not_measured("gpu.retired_pages", CheckStatus::kSkip, "no page retirement on this GPU (it remaps rows: gpu.remap)", target));
    }
    // NVLink.
    auto after = (*nvml)->nvlinks(i);
    const char* link_checks[] = {"gpu.nvlink_down", "gpu.nvlink_active", "gpu.nvlink_crc", "gpu.nvlink_replay", "gpu.nvlink_recovery", "gpu.nvlink_rise"};
    if (!after || !before[i]) {
      const std::string why = (!after ? after : before[i]).error().message;
      for (const char* c : link_checks) out.push_back(not_measured(c, CheckStatus::kError, why, target));
      continue;
    }
    if (after->empty()) {
      for (const char* c : link_checks) out.push_back(not_measured(c, CheckStatus::kSkip, "no NVLink on this GPU", target));
      continue;
    }
    const LinkTotals a = totals(*before[i]), b = totals(*after);
    std::string down;
    for (unsigned l : b.down) down += fmt::format("{}{}", down.empty() ? "" : ",", l);
    out.push_back(measured("gpu.nvlink_down", b.down.size(), down.empty() ? fmt::format("all {} links up", b.links) : "down: link " + down, target));
    out.push_back(measured("gpu.nvlink_active", b.active, fmt::format("of {} links", b.links), target));
    auto counter = [&](const char* check, const Counter& c, const char* what) {
      if (!c.reported) return out.push_back(not_measured(check, CheckStatus::kSkip, "not reported by this GPU or driver", target));
      out.push_back(measured(check, static_cast<double>(c.total),
                             c.most ? fmt::format("{} since the driver loaded, all links; most on link {} ({})", what, c.worst_link, c.most)
                                    : fmt::format("{} since the driver loaded, all links", what),
                             target));
    };
    counter("gpu.nvlink_crc", b.crc, "receive CRC errors (flit and data)");
    counter("gpu.nvlink_replay", b.replay, "transmit replays");
    counter("gpu.nvlink_recovery", b.recovery, "link recoveries");
    // Counters only grow; a smaller second reading means they were reset in between.
    auto rise = [](const Counter& x, const Counter& y) { return y.total > x.total ? y.total - x.total : 0; };
    const std::uint64_t up = rise(a.crc, b.crc) + rise(a.replay, b.replay) + rise(a.recovery, b.recovery);
    out.push_back(measured("gpu.nvlink_rise", static_cast<double>(up),
                           fmt::format("CRC +{}, replay +{}, recovery +{} over {:.0f} s at the end of vet", rise(a.crc, b.crc),
                                       rise(a.replay, b.replay), rise(a.recovery, b.recovery), watched),
                           target));
  }
  // Xids of a GPU NVML does not list: it may have fallen off the bus.
  for (const auto& [addr, xs] : orphans) {
    Measurement m = measured("gpu.xid", static_cast<double>(xs.size()), describe(xs), "pci:" + addr);
    if (const auto* c = critical_in(xs)) {
      m.status = CheckStatus::kFail;
      m.reason = fmt::format("Xid {} for PCI {}, a GPU NVML no longer lists ({})", c->xid, addr, c->message.substr(0, 80));
    }
    out.push_back(m);
  }
  return out;
}

std::vector<Measurement> run_topology(const ProbeContext& ctx) {
  auto nvml = hw::Nvml::open();
  std::vector<Measurement> none;
  const unsigned count = visible_gpus(nvml, kTopologyChecks, &none);
  if (count == 0) return none;
  const std::string root = vet_root();
  auto expected_list = parse_list("numa_nodes", ctx.params.at("numa_nodes").get<std::string>());
  if (!expected_list) return skip_each(kTopologyChecks, expected_list.error().message, CheckStatus::kError);
  const std::vector<long long>& expected = *expected_list;
  const std::vector<hw::RdmaNic> nics = hw::read_rdma_nics(root);
  std::vector<Measurement> out;
  for (unsigned i = 0; i < count; ++i) {
    const std::string target = fmt::format("gpu{}", i);
    const std::string pci = (*nvml)->pci_bus_id(i);
    auto node = pci.empty() ? Expected<int>(Error{ErrorKind::kIo, "NVML gave no PCI address"}) : hw::read_pci_numa_node(pci, root);
    if (!node) {
      for (const char* c : kTopologyChecks) out.push_back(not_measured(c, CheckStatus::kSkip, node.error().message, target));
      continue;
    }
    Measurement m = measured("gpu.numa_node", *node,
                             *node < 0 ? fmt::format("{}: no NUMA affinity reported", pci) : fmt::format("{} on NUMA node {}", pci, *node), target);
    if (i < expected.size() && expected[i] != *node) {
      m.status = CheckStatus::kFail;
      m.reason = fmt::format("{} is on NUMA node {}, the profile expects {}", pci, *node, expected[i]);
    } else if (!expected.empty() && i >= expected.size()) {
      m.status = CheckStatus::kFail;
      m.reason = fmt::format("the profile's numa_nodes lists {} GPUs; this is gpu {}", expected.size(), i);
    }
    out.push_back(m);
    if (nics.empty()) {
      out.push_back(not_measured("gpu.nic_numa", CheckStatus::kSkip, "no RDMA NIC (" + root + "/sys/class/infiniband is empty or missing)", target));
      continue;
    }
    std::string near;
    unsigned same = 0;
    for (const auto& nic : nics)
      if (nic.numa_node == *node) ++same, near += (near.empty() ? "" : ",") + nic.name;
    out.push_back(measured("gpu.nic_numa", same,
                           same ? fmt::format("on NUMA node {}: {}", *node, near)
                                : fmt::format("none of {} RDMA NICs is on NUMA node {}", nics.size(), *node),
                           target));
  }
  return out;
}

}  // namespace

std::vector<ProbeSpec> gpu_error_probes() {
  auto num = [](const char* name, const char* unit, const char* help) {
    return CheckSpec{name, "gpu", unit, ValueKind::kNumber, Direction::kNone, help};
  };
  std::vector<ProbeSpec> v;
  v.push_back({"gpu.errors",
               {num("gpu.xid", "Xids", "Xid reports in the kernel log since boot; a critical Xid fails"),
                num("gpu.xid_new", "Xids", "Xids raised during this vet (kernel log and NVML events)"),
                num("gpu.retired_pages", "pages", "pages retired for ECC errors (before Ampere); a pending retirement fails"),
                num("gpu.nvlink_down", "links", "NVLinks that are down"),
                num("gpu.nvlink_active", "links", "NVLinks that are up"),
                num("gpu.nvlink_crc", "errors", "NVLink receive CRC errors since the driver loaded, all links"),
                num("gpu.nvlink_replay", "replays", "NVLink transmit replays since the driver loaded, all links"),
                num("gpu.nvlink_recovery", "recoveries", "NVLink recoveries since the driver loaded, all links"),
                num("gpu.nvlink_rise", "errors", "rise of the NVLink error counters while the probe watches")},
               {{"watch", ParamType::kDuration, "3s", "1s", "how long to wait for Xid events and NVLink counter rises"},
                {"critical_xids", ParamType::kString, "48,61,62,63,64,74,79,92,94,95,119,120", "48,61,62,63,64,74,79,92,94,95,119,120",
                 "Xids that fail the GPU when seen since boot"}},
               "", false, 30, 15, run_gpu_errors});
  v.push_back({"gpu.topology",
               {num("gpu.numa_node", "node", "the GPU's NUMA node against the profile's numa_nodes"),
                num("gpu.nic_numa", "NICs", "RDMA NICs on the GPU's NUMA node")},
               {{"numa_nodes", ParamType::kString, "", "", "expected NUMA node of each GPU, comma-separated (empty: any)"}},
               "", false, 10, 10, run_topology});
  return v;
}

}  // namespace pacer::vet
