// Software probe: the versions a job depends on, recorded for cross-node drift checks.
#include <fmt/format.h>

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

}  // namespace

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
           {}, "", false, 10, 10, run_software}};
}

}  // namespace pacer::vet
