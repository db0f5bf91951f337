#include "pacer/hw/libraries.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <gnu/libc-version.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cuda_library.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::hw {
namespace {

void* open_first(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (void* h = ::dlopen(n, RTLD_LAZY | RTLD_LOCAL)) return h;
  }
  return nullptr;
}

}  // namespace

const NcclLibrary& nccl_library() {
  static const NcclLibrary lib = [] {
    NcclLibrary l;
    std::string tried;
    if (const char* p = std::getenv("PACER_NCCL_LIBRARY"); p && *p) {
      l.handle = ::dlopen(p, RTLD_NOW | RTLD_LOCAL);
      if (!l.handle) {
        const char* why = ::dlerror();
        tried = fmt::format("{} (PACER_NCCL_LIBRARY): {}", p, why ? why : "does not load");
      }
    } else {
      l.handle = open_cuda_library({"libnccl.so.2", "libnccl.so"}, &tried);
    }
    if (!l.handle) l.error = fmt::format("cannot load NCCL (tried {}; set PACER_NCCL_LIBRARY to libnccl.so.2)", tried);
    return l;
  }();
  return lib;
}

void* SymbolBinder::lookup(const char* name) const { return library_ ? ::dlsym(library_, name) : nullptr; }

std::string SymbolBinder::error() const {
  return missing_.empty() ? "" : fmt::format("{} lacks {} (too old?)", what_, missing_);
}

std::string nccl_version_text(int code) {
  // NCCL encodes 2.19.3 as 21903; releases before 2.9 used 1000s.
  if (code >= 10000) return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100);
}

std::string nccl_version() {
  int (*get_version)(int*) = nullptr;
  SymbolBinder bind(nccl_library().handle, "NCCL");
  bind(get_version, "ncclGetVersion");
  int v = 0;
  if (!get_version || get_version(&v) != 0 || v <= 0) return "";
  return nccl_version_text(v);
}

std::string mpi_library_version() {
  void* h = open_first({"libmpi.so.40", "libmpi.so.12", "libmpi.so"});
  if (!h) return "";
  std::string out;
  // MPI_Get_library_version may be called before MPI_Init (MPI-3 8.1.1).
  using Fn = int (*)(char*, int*);
  if (auto fn = reinterpret_cast<Fn>(::dlsym(h, "MPI_Get_library_version"))) {
    std::string buf(8192, '\0');
    int len = 0;
    if (fn(buf.data(), &len) == 0) {
      buf.resize(static_cast<std::size_t>(std::max(len, 0)));
      out = buf.substr(0, buf.find_first_of("\n,"));
      while (!out.empty() && (out.back() == ' ' || out.back() == '\0')) out.pop_back();
    }
  }
  ::dlclose(h);
  return out;
}

std::string cuda_toolkit_version() {
  std::string root = "/usr/local/cuda";
  if (const char* home = std::getenv("CUDA_HOME"); home && *home) root = home;
  if (auto text = read_text(root + "/version.json")) {
    auto j = nlohmann::json::parse(*text, nullptr, false);
    if (!j.is_discarded() && j.contains("cuda") && j["cuda"].contains("version") && j["cuda"]["version"].is_string())
      return j["cuda"]["version"].get<std::string>();
  }
  // Toolkits installed from wheels ship no version.json; the runtime header
  // always carries CUDART_VERSION (13000 for 13.0).
  if (auto text = read_text(root + "/include/cuda_runtime_api.h")) {
    const std::string key = "#define CUDART_VERSION";
    if (auto pos = text->find(key); pos != std::string::npos) {
      const int v = std::atoi(text->c_str() + pos + key.size());
      if (v > 0) return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
    }
  }
  return "";
}

std::string glibc_version() { return gnu_get_libc_version(); }

namespace {

// The file a loaded symbol lives in, with symlinks resolved: the name of the
// real file usually carries the full version (libfabric.so.1.18.2).
std::string file_of(const void* symbol) {
  Dl_info info{};
  if (!symbol || ::dladdr(symbol, &info) == 0 || !info.dli_fname) return "";
  std::error_code ec;
  const auto real = std::filesystem::canonical(info.dli_fname, ec);
  return ec ? std::string(info.dli_fname) : real.string();
}

}  // namespace

std::string nccl_net_plugin() {
  std::string lib = "libnccl-net.so";
  if (const char* p = std::getenv("NCCL_NET_PLUGIN"); p && *p) {
    const std::string v = p;
    if (v == "none") return "";
    lib = v.find('/') != std::string::npos || v.ends_with(".so") ? v : "libnccl-net-" + v + ".so";
  }
  void* h = ::dlopen(lib.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (!h) return "";
  // Every ncclNet_vN struct starts with the plugin's name.
  for (int v = 12; v >= 2; --v) {
    const void* sym = ::dlsym(h, fmt::format("ncclNetPlugin_v{}", v).c_str());
    if (!sym) continue;
    const char* name = *static_cast<const char* const*>(sym);
    return fmt::format("{} v{} ({})", name ? name : "unnamed", v, file_of(sym));
  }
  return fmt::format("no ncclNetPlugin_vN symbol ({})", lib);
}

std::string libfabric_version() {
  void* h = ::dlopen("libfabric.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!h) return "";
  using Fn = std::uint32_t (*)();
  auto fn = reinterpret_cast<Fn>(::dlsym(h, "fi_version"));
  if (!fn) return "";
  const std::uint32_t v = fn();  // FI_VERSION(major, minor): major in the high 16 bits
  return fmt::format("{}.{} ({})", v >> 16, v & 0xffff, file_of(reinterpret_cast<const void*>(fn)));
}

}  // namespace pacer::hw
