// Fabric probes: InfiniBand/RoCE ports and HPE Slingshot (cxi) links from sysfs.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

constexpr const char* kIbChecks[] = {"fabric.ib_state",       "fabric.ib_phys_state", "fabric.ib_rate",
                                     "fabric.ib_symbol_errors", "fabric.ib_link_downed", "fabric.ib_link_flaps",
                                     "fabric.ib_rcv_errors"};
constexpr const char* kCxiChecks[] = {"fabric.cxi_link_restarts", "fabric.cxi_link_flaps"};

// "mlx5_0" selects every port of the device, "mlx5_0/1" one port.
bool selected(const std::vector<std::string>& wanted, const std::string& device, const std::string& target) {
  if (wanted.empty()) return true;
  return std::find(wanted.begin(), wanted.end(), device) != wanted.end() ||
         std::find(wanted.begin(), wanted.end(), target) != wanted.end();
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t end = std::min(s.find(',', pos), s.size());
    std::string item = s.substr(pos, end - pos);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    pos = end + 1;
  }
  return out;
}

Measurement counter(const char* check, const std::optional<std::uint64_t>& v, const std::string& file, const std::string& target) {
  if (!v) return not_measured(check, CheckStatus::kSkip, fmt::format("the driver has no counters/{}", file), target);
  return measured(check, static_cast<double>(*v), fmt::format("counters/{} since the counters were last reset", file), target);
}

// Slingshot restart timestamps: /sys/class/cxi/cxiN/device/link_restarts/time_0..9
// hold the times of the last ten link restarts (0 where none happened).
std::map<std::string, std::vector<std::string>> read_cxi_restarts(const std::string& root) {
  std::map<std::string, std::vector<std::string>> out;
  std::error_code ec;
  for (const auto& d : std::filesystem::directory_iterator(root + "/sys/class/cxi", ec)) {
    const auto dir = d.path() / "device" / "link_restarts";
    std::vector<std::string> times;
    for (int i = 0; i < 10; ++i) {
      auto t = hw::read_text((dir / fmt::format("time_{}", i)).string());
      times.push_back(t ? *t : "");
    }
    out[d.path().filename().string()] = std::move(times);
  }
  return out;
}

bool recorded(const std::string& t) { return !t.empty() && t.find_first_not_of("0 \t.") != std::string::npos; }

std::vector<Measurement> run_fabric(const ProbeContext& ctx) {
  return measure_fabric(vet_root(), ctx.params.at("devices").get<std::string>(), ctx.seconds("window"), {});
}

}  // namespace

std::vector<Measurement> measure_fabric(const std::string& root, const std::string& devices, double window_s,
                                        const std::function<void()>& between) {
  std::vector<Measurement> out;
  const std::vector<std::string> wanted = split_list(devices);
  std::vector<hw::IbPort> before;
  for (auto& p : hw::read_ib_ports(root))
    if (selected(wanted, p.device, fmt::format("{}/{}", p.device, p.port))) before.push_back(std::move(p));
  const auto cxi_before = read_cxi_restarts(root);
  if (!before.empty() || !cxi_before.empty()) {
    // A flapping link goes down and up again within seconds: two reads of
    // link_downed a window apart catch one that flaps now.
    if (between) between();
    else std::this_thread::sleep_for(std::chrono::duration<double>(window_s));
  }
  std::map<std::string, hw::IbPort> after;
  for (auto& p : hw::read_ib_ports(root)) after[fmt::format("{}/{}", p.device, p.port)] = std::move(p);
  const auto cxi_after = read_cxi_restarts(root);

  if (before.empty()) {
    const std::string why = wanted.empty() ? "no InfiniBand or RoCE device under /sys/class/infiniband"
                                           : fmt::format("none of the devices '{}' under /sys/class/infiniband", devices);
    for (const char* c : kIbChecks) out.push_back(not_measured(c, CheckStatus::kSkip, why));
  }
  for (const auto& p : before) {
    const std::string target = fmt::format("{}/{}", p.device, p.port);
    const std::string layer = p.link_layer.empty() ? "" : fmt::format(" ({})", p.link_layer);
    if (p.state.empty()) out.push_back(not_measured("fabric.ib_state", CheckStatus::kError, "cannot read the port's state", target));
    else out.push_back(measured_text("fabric.ib_state", p.state, "port state" + layer, target));
    if (p.phys_state.empty())
      out.push_back(not_measured("fabric.ib_phys_state", CheckStatus::kError, "cannot read the port's phys_state", target));
    else out.push_back(measured_text("fabric.ib_phys_state", p.phys_state, "physical link state" + layer, target));
    // A port that is not up reports a nominal rate that says nothing.
    if (p.state != "ACTIVE")
      out.push_back(not_measured("fabric.ib_rate", CheckStatus::kSkip, fmt::format("port is {}", p.state.empty() ? "unreadable" : p.state), target));
    else if (!p.rate_gbits)
      out.push_back(not_measured("fabric.ib_rate", CheckStatus::kError, fmt::format("unreadable rate '{}'", p.rate), target));
    else out.push_back(measured("fabric.ib_rate", *p.rate_gbits, p.rate, target));
    out.push_back(counter("fabric.ib_symbol_errors", p.symbol_errors, "symbol_error", target));
    out.push_back(counter("fabric.ib_link_downed", p.link_downed, "link_downed", target));
    const auto a = after.find(target);
    if (!p.link_downed) {
      out.push_back(not_measured("fabric.ib_link_flaps", CheckStatus::kSkip, "the driver has no counters/link_downed", target));
    } else if (a == after.end() || !a->second.link_downed) {
      out.push_back(not_measured("fabric.ib_link_flaps", CheckStatus::kError, "the port disappeared during the window", target));
    } else {
      // The counter may have been reset in between: a drop is no flap.
      const std::uint64_t d = *a->second.link_downed >= *p.link_downed ? *a->second.link_downed - *p.link_downed : 0;
      out.push_back(measured("fabric.ib_link_flaps", static_cast<double>(d),
                             fmt::format("link_downed rose by {} over {}", d, format_duration(window_s)), target));
    }
    out.push_back(counter("fabric.ib_rcv_errors", p.rcv_errors, "port_rcv_errors", target));
  }

  if (cxi_before.empty()) {
    for (const char* c : kCxiChecks) out.push_back(not_measured(c, CheckStatus::kSkip, "no Slingshot (cxi) device under /sys/class/cxi"));
  }
  for (const auto& [dev, times] : cxi_before) {
    int restarts = 0, changed = 0;
    const auto a = cxi_after.find(dev);
    for (std::size_t i = 0; i < times.size(); ++i) {
      if (recorded(times[i])) ++restarts;
      if (a != cxi_after.end() && a->second[i] != times[i] && recorded(a->second[i])) ++changed;
    }
    if (std::none_of(times.begin(), times.end(), [](const std::string& t) { return !t.empty(); })) {
      for (const char* c : kCxiChecks)
        out.push_back(not_measured(c, CheckStatus::kSkip, "the cxi driver has no device/link_restarts", dev));
      continue;
    }
    out.push_back(measured("fabric.cxi_link_restarts", restarts, "restarts recorded in device/link_restarts (the last ten)", dev));
    out.push_back(measured("fabric.cxi_link_flaps", changed, fmt::format("link restarts over {}", format_duration(window_s)), dev));
  }
  return out;
}

std::vector<ProbeSpec> fabric_probes() {
  auto num = [](const char* name, const char* unit, Direction d, const char* help) {
    return CheckSpec{name, "fabric", unit, ValueKind::kNumber, d, help};
  };
  auto text = [](const char* name, const char* help) {
    return CheckSpec{name, "fabric", "", ValueKind::kText, Direction::kNone, help};
  };
  return {{"fabric",
           {text("fabric.ib_state", "InfiniBand/RoCE port state (ACTIVE, DOWN, INIT, ARMED)"),
            text("fabric.ib_phys_state", "physical link state (LinkUp, Polling, Disabled, ...)"),
            num("fabric.ib_rate", "Gb/s", Direction::kHigher, "link rate of an active port"),
            num("fabric.ib_symbol_errors", "errors", Direction::kNone, "symbol errors since the counters were reset"),
            num("fabric.ib_link_downed", "events", Direction::kNone, "times the link went down since the counters were reset"),
            num("fabric.ib_link_flaps", "events", Direction::kNone, "times the link went down during the probe's window"),
            num("fabric.ib_rcv_errors", "errors", Direction::kNone, "packets received with errors since the counters were reset"),
            num("fabric.cxi_link_restarts", "events", Direction::kNone, "Slingshot link restarts recorded by the cxi driver (up to 10)"),
            num("fabric.cxi_link_flaps", "events", Direction::kNone, "Slingshot link restarts during the probe's window")},
           {{"devices", ParamType::kString, "", "", "RDMA devices (mlx5_0) or ports (mlx5_0/1) to check, comma-separated; empty: all"},
            {"window", ParamType::kDuration, "2s", "500ms", "time between the two reads of the link-down counters"}},
           "",
           false,
           10,
           5,
           run_fabric}};
}

}  // namespace pacer::vet
