#include "probes.hpp"

namespace pacer::vet {

volatile std::sig_atomic_t g_probe_cancelled = 0;

const std::vector<ProbeSpec>& all_probes() {
  static const std::vector<ProbeSpec> kProbes = [] {
    std::vector<ProbeSpec> all;
    // The GPU error probe runs after the load probes, so that what they made
    // the GPUs report (Xids, NVLink errors) counts as "during vet".
    for (auto group : {system_probes, software_probes, gpu_probes, fabric_probes, grace_probes, cpu_probes, memory_probes, storage_probes,
                       gpu_active_probes, grace_active_probes, gpu_error_probes}) {
      for (auto& p : group()) all.push_back(std::move(p));
    }
    return all;
  }();
  return kProbes;
}

const ProbeSpec* probe_of_check(const std::string& name) {
  for (const auto& p : all_probes())
    for (const auto& c : p.checks)
      if (c.name == name) return &p;
  return nullptr;
}

const CheckSpec* find_check(const std::string& name) {
  for (const auto& p : all_probes())
    for (const auto& c : p.checks)
      if (c.name == name) return &c;
  return nullptr;
}

bool is_cluster_check(const std::string& name) { return name == "network.p2p" || name == "cluster.report"; }

Measurement measured(const std::string& check, double value, std::string detail, std::string target) {
  Measurement m;
  m.check = check;
  m.value = value;
  m.detail = std::move(detail);
  m.target = std::move(target);
  return m;
}

Measurement measured_text(const std::string& check, std::string text, std::string detail, std::string target) {
  Measurement m;
  m.check = check;
  m.text = std::move(text);
  m.detail = std::move(detail);
  m.target = std::move(target);
  return m;
}

Measurement not_measured(const std::string& check, CheckStatus status, std::string reason, std::string target) {
  Measurement m;
  m.check = check;
  m.status = status;
  m.reason = std::move(reason);
  m.target = std::move(target);
  return m;
}

}  // namespace pacer::vet
