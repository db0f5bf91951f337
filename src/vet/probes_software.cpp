// Software probe: the versions a job depends on, recorded for cross-node drift checks.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>

#include "pacer/hw/libraries.hpp"
#include "pacer/hw/nvml.hpp"
#include "pacer/hw/system.hpp"
#include "probes.hpp"

namespace pacer::vet {
namespace {

Measurement version(const std::string& check, const std::string& v, const std::string& source, const std::string& missing) {
  if (v.empty()) return not_measured(check, CheckStatus::kSkip, missing);
  return measured_text(check, v, source);
}

std::vector<Measurement> run_software(const ProbeContext&) {
  std::vector<Measurement> out;
  out.push_back(measured_text("software.kernel", hw::kernel_release(), "uname -r"));
  out.push_back(measured_text("software.glibc", hw::glibc_version(), "gnu_get_libc_version"));
  std::string driver, cuda, why = "no NVIDIA driver";
  if (auto nvml = hw::Nvml::open()) {
    driver = (*nvml)->driver_version();
    cuda = (*nvml)->cuda_driver_version();
  } else {
    why = nvml.error().message;
  }
  out.push_back(version("software.driver", driver, "NVML", why));
  out.push_back(version("software.cuda_driver", cuda, "highest CUDA the driver supports (NVML)", why));
  out.push_back(version("software.cuda_toolkit", hw::cuda_toolkit_version(), "$CUDA_HOME or /usr/local/cuda",
                        "no CUDA toolkit at $CUDA_HOME or /usr/local/cuda"));
  out.push_back(version("software.nccl", hw::nccl_version(), "ncclGetVersion", "libnccl.so.2 not found"));
  out.push_back(version("software.mpi", hw::mpi_library_version(), "MPI_Get_library_version", "libmpi not found"));
  return out;
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) env.emplace_back(*e);
  return env;
}

std::set<std::string> split_names(const std::string& s) {
  std::set<std::string> out;
  std::istringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.insert(item);
  }
  return out;
}

std::vector<Measurement> run_software_fabric(const ProbeContext& ctx) {
  std::vector<Measurement> out;
  const auto env = current_environment();
  const auto ignore = split_names(ctx.params.at("ignore").get<std::string>());
  for (const auto& [check, prefix] : {std::pair{"software.nccl_env", "NCCL_"}, std::pair{"software.fi_env", "FI_"}}) {
    const std::string text = environment_text(env, prefix, ignore);
    if (text.empty()) out.push_back(not_measured(check, CheckStatus::kSkip, fmt::format("no {}* variable set", prefix)));
    else out.push_back(measured_text(check, text, fmt::format("the {}* environment", prefix)));
  }
  const ContainerIdentity c = container_identity(env, vet_root());
  if (c.text.empty()) out.push_back(not_measured("software.container", CheckStatus::kSkip, c.source));
  else out.push_back(measured_text("software.container", c.text, c.source));
  out.push_back(version("software.nccl_net", hw::nccl_net_plugin(), "the plugin NCCL loads ($NCCL_NET_PLUGIN or libnccl-net.so)",
                        "no NCCL network plugin (libnccl-net.so) found: NCCL uses its own IB and socket transports"));
  out.push_back(version("software.libfabric", hw::libfabric_version(), "fi_version", "libfabric.so.1 not found"));
  return out;
}

const std::string* env_value(const std::vector<std::string>& env, const std::string& name) {
  for (const auto& e : env)
    if (e.size() > name.size() && e[name.size()] == '=' && e.compare(0, name.size(), name) == 0) return &e;
  return nullptr;
}

}  // namespace

std::string environment_text(const std::vector<std::string>& env, const std::string& prefix, const std::set<std::string>& ignore) {
  std::vector<std::string> kept;
  for (const auto& e : env) {
    const auto eq = e.find('=');
    if (eq == std::string::npos || !e.starts_with(prefix) || ignore.count(e.substr(0, eq))) continue;
    kept.push_back(e);
  }
  std::sort(kept.begin(), kept.end());
  std::string out;
  for (const auto& k : kept) out += (out.empty() ? "" : " ") + k;
  return out;
}

ContainerIdentity container_identity(const std::vector<std::string>& env, const std::string& root) {
  // What each runtime leaves in the environment of the processes it starts;
  // several may apply (an NGC image started by Pyxis), and all are kept.
  static const std::pair<const char*, const char*> kVars[] = {
      {"PYXIS_CONTAINER_IMAGE", "Pyxis"},       {"NVIDIA_BUILD_ID", "NGC image"}, {"NVIDIA_PIPELINE_ID", "NGC image"},
      {"SLURM_UENV", "uenv"},                   {"UENV_MOUNT_LIST", "uenv"},      {"UENV_VIEW", "uenv"},
      {"APPTAINER_CONTAINER", "Apptainer"},     {"SINGULARITY_CONTAINER", "Singularity"}, {"SINGULARITY_NAME", "Singularity"},
      {"container", "container runtime"}};
  ContainerIdentity id;
  std::vector<std::string> parts, sources;
  auto add_source = [&](const std::string& s) {
    if (std::find(sources.begin(), sources.end(), s) == sources.end()) sources.push_back(s);
  };
  for (const auto& [name, source] : kVars)
    if (const std::string* e = env_value(env, name)) {
      parts.push_back(*e);
      add_source(source);
    }
  // Podman writes the image's name and id to /run/.containerenv (with --privileged).
  if (auto t = hw::read_text(root + "/run/.containerenv")) {
    std::istringstream in(*t);
    for (std::string line; std::getline(in, line);) {
      for (const char* key : {"image=", "imageid="})
        if (line.starts_with(key)) {
          std::string v = line.substr(std::string(key).size());
          if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);
          if (!v.empty()) {
            parts.push_back(fmt::format("containerenv.{}{}", key, v));
            add_source("Podman /run/.containerenv");
          }
        }
    }
  }
  for (const auto& p : parts) id.text += (id.text.empty() ? "" : " ") + p;
  if (id.text.empty()) {
    id.source = "no container identity (Pyxis, NGC, uenv, Apptainer, Podman) in the environment";
  } else {
    for (const auto& s : sources) id.source += (id.source.empty() ? "" : ", ") + s;
  }
  return id;
}

std::vector<ProbeSpec> software_probes() {
  auto text = [](const char* name, const char* help) {
    return CheckSpec{name, "software", "", ValueKind::kText, Direction::kNone, help};
  };
  return {{"software",
           {text("software.kernel", "kernel release"), text("software.glibc", "C library version"),
            text("software.driver", "NVIDIA driver version"),
            text("software.cuda_driver", "CUDA version the driver supports"),
            text("software.cuda_toolkit", "CUDA toolkit version"), text("software.nccl", "NCCL library version"),
            text("software.mpi", "MPI library version")},
           {}, "", false, 10, 10, run_software},
          {"software.fabric",
           {text("software.nccl_env", "NCCL_* environment variables, sorted"),
            text("software.fi_env", "FI_* (libfabric) environment variables, sorted"),
            text("software.container", "container image identity (Pyxis, NGC, uenv, Apptainer, Podman)"),
            text("software.nccl_net", "NCCL network plugin (libnccl-net.so): name, interface version, file"),
            text("software.libfabric", "libfabric API version and file")},
           {{"ignore", ParamType::kString, "", "", "NCCL_*/FI_* variables left out of the drift check, comma-separated"}},
           "", false, 10, 10, run_software_fabric}};
}

}  // namespace pacer::vet
