#include "pacer/hw/cuda_host.hpp"

#include <dlfcn.h>

#include "cuda_library.hpp"

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
    void* h = open_cuda_library({"libcudart.so", "libcudart.so.13", "libcudart.so.12"});
    if (!h) return;
    rt.host_register = reinterpret_cast<int (*)(void*, std::size_t, unsigned)>(::dlsym(h, "cudaHostRegister"));
    rt.host_unregister = reinterpret_cast<int (*)(void*)>(::dlsym(h, "cudaHostUnregister"));
    if (!rt.host_register || !rt.host_unregister) rt = CudaRuntime{};
  });
  return rt;
}

}  // namespace

void* open_cuda_library(std::initializer_list<const char*> names, std::string* tried) {
  std::string home = "/usr/local/cuda";
  if (const char* h = std::getenv("CUDA_HOME"); h && *h) home = h;
  std::vector<std::string> candidates(names.begin(), names.end());
  for (const char* n : names) {
    candidates.push_back(home + "/lib64/" + n);
    if (home != "/usr/local/cuda") candidates.push_back(std::string("/usr/local/cuda/lib64/") + n);
  }
  for (const auto& c : candidates) {
    if (void* h = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    if (tried) *tried += (tried->empty() ? "" : ", ") + c;
  }
  return nullptr;
}

bool pin_host_memory(void* ptr, std::size_t bytes) {
  const auto& rt = runtime();
  return rt.host_register && rt.host_register(ptr, bytes, 0) == 0;
}

void unpin_host_memory(void* ptr) {
  const auto& rt = runtime();
  if (rt.host_unregister) rt.host_unregister(ptr);
}

}  // namespace pacer::hw
