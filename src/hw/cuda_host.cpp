#include "pacer/hw/cuda_host.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace pacer::hw {
namespace {

struct CudaRuntime {
  int (*host_register)(void*, std::size_t, unsigned) = nullptr;
  int (*host_unregister)(void*) = nullptr;
};

const CudaRuntime& runtime() {
  static CudaRuntime rt;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> names = {"libcudart.so", "libcudart.so.13", "libcudart.so.12"};
    // Toolkits are often not on the loader's path.
    std::string home = "/usr/local/cuda";
    if (const char* h = std::getenv("CUDA_HOME"); h && *h) home = h;
    for (const char* n : {"libcudart.so", "libcudart.so.13", "libcudart.so.12"}) names.push_back(home + "/lib64/" + n);
    for (const auto& name : names) {
      void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) continue;
      rt.host_register = reinterpret_cast<int (*)(void*, std::size_t, unsigned)>(::dlsym(h, "cudaHostRegister"));
      rt.host_unregister = reinterpret_cast<int (*)(void*)>(::dlsym(h, "cudaHostUnregister"));
      if (rt.host_register && rt.host_unregister) return;
      rt = CudaRuntime{};
    }
  });
  return rt;
}

}  // namespace

bool pin_host_memory(void* ptr, std::size_t bytes) {
  const auto& rt = runtime();
  return rt.host_register && rt.host_register(ptr, bytes, 0) == 0;
}

void unpin_host_memory(void* ptr) {
  const auto& rt = runtime();
  if (rt.host_unregister) rt.host_unregister(ptr);
}

}  // namespace pacer::hw
