// The run-time libraries a training job depends on (NCCL, MPI, CUDA toolkit): their versions, and the one NCCL loader.
#pragma once

#include <string>
#include <utility>

namespace pacer::hw {

// Each returns an empty string when the library cannot be found. Nothing is
// initialised; MPI is unloaded again, NCCL stays loaded (nccl_library()).
std::string nccl_version();         // "2.27.3", from ncclGetVersion
std::string mpi_library_version();  // first line of MPI_Get_library_version
std::string cuda_toolkit_version(); // from $CUDA_HOME or /usr/local/cuda version.json
std::string glibc_version();
// The NCCL network plugin NCCL would load: $NCCL_NET_PLUGIN (a path, or NAME
// for libnccl-net-NAME.so), else libnccl-net.so. "NAME vN (PATH)": the name
// the plugin gives itself, the newest ncclNetPlugin_vN interface it exports
// and the file it resolved to. Empty when none loads.
std::string nccl_net_plugin();
// libfabric's release (major.minor, from fi_version) and the real file behind
// libfabric.so.1: "1.17 (/usr/lib/x86_64-linux-gnu/libfabric.so.1.20.0)".
std::string libfabric_version();

// The NCCL library every part of pacer uses (vet's version and bandwidth
// checks, the comm backend), loaded once per process and never unloaded, so
// that all of them talk to the same NCCL and a communicator never outlives
// its library: $PACER_NCCL_LIBRARY when set (PyTorch wheels carry their own;
// a path that does not load is an error, not replaced by another NCCL), else
// libnccl.so.2 on the loader's path or in the CUDA toolkit. Thread-safe.
struct NcclLibrary {
  void* handle = nullptr;  // from dlopen; nullptr when none loads
  std::string error;       // when none loads: what was tried, and how to point pacer at one
};
const NcclLibrary& nccl_library();

// Points `fn` at the function `name` of a library loaded with dlopen. The
// first name missing is remembered, so that each loader (NCCL's users,
// cuBLASLt) reports an incomplete library in the same words.
class SymbolBinder {
 public:
  SymbolBinder(void* library, std::string what) : library_(library), what_(std::move(what)) {}
  template <class Fn>
  void operator()(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(lookup(name));
    if (!fn && missing_.empty()) missing_ = name;
  }
  bool ok() const { return missing_.empty(); }
  // "WHAT lacks NAME (too old?)" for the first missing name; "" when none is.
  std::string error() const;

 private:
  void* lookup(const char* name) const;
  void* library_;
  std::string what_;
  std::string missing_;
};
// "2.28.9" from ncclGetVersion's code (releases before 2.9 counted in 1000s).
std::string nccl_version_text(int code);

}  // namespace pacer::hw
