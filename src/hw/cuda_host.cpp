#include "pacer/hw/cuda_host.hpp"

#include <dlfcn.h>

#include "cuda_library.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pacer::hw {
namespace {

constexpr unsigned kStreamNonBlocking = 0x1;  // cudaStreamNonBlocking
constexpr unsigned kEventDisableTiming = 0x2;  // cudaEventDisableTiming
constexpr int kMemcpyDeviceToHost = 2;         // cudaMemcpyDeviceToHost

struct CudaRuntime {
  void* handle = nullptr;
  std::string tried;  // the libraries attempted, when none loaded
  int (*host_register)(void*, std::size_t, unsigned) = nullptr;
  int (*host_unregister)(void*) = nullptr;
  // Device-to-host copies: all or none of these.
  int (*get_device_count)(int*) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*stream_create)(void**, unsigned) = nullptr;
  int (*stream_destroy)(void*) = nullptr;
  int (*stream_synchronize)(void*) = nullptr;
  int (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*event_synchronize)(void*) = nullptr;
  int (*event_query)(void*) = nullptr;
  int (*memcpy_async)(void*, const void*, std::size_t, int, void*) = nullptr;
  int (*get_last_error)() = nullptr;
  const char* (*get_error_string)(int) = nullptr;
  bool copies = false;
};

template <class Fn>
void load(void* h, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(::dlsym(h, name));
}

const CudaRuntime& runtime() {
  static CudaRuntime rt;
  static std::once_flag once;
  std::call_once(once, [] {
    // The runtime the process already has (PyTorch's) first: one runtime
    // means one notion of the current device and of the legacy default stream.
    void* h = nullptr;
    for (const char* n : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"})
      if ((h = ::dlopen(n, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL))) break;
    if (!h) h = open_cuda_library({"libcudart.so", "libcudart.so.13", "libcudart.so.12"}, &rt.tried);
    if (!h) return;
    rt.handle = h;
    load(h, rt.host_register, "cudaHostRegister");
    load(h, rt.host_unregister, "cudaHostUnregister");
    if (!rt.host_register || !rt.host_unregister) rt.host_register = nullptr, rt.host_unregister = nullptr;
    load(h, rt.get_device_count, "cudaGetDeviceCount");
    load(h, rt.get_device, "cudaGetDevice");
    load(h, rt.set_device, "cudaSetDevice");
    load(h, rt.stream_create, "cudaStreamCreateWithFlags");
    load(h, rt.stream_destroy, "cudaStreamDestroy");
    load(h, rt.stream_synchronize, "cudaStreamSynchronize");
    load(h, rt.stream_wait_event, "cudaStreamWaitEvent");
    load(h, rt.event_create, "cudaEventCreateWithFlags");
    load(h, rt.event_destroy, "cudaEventDestroy");
    load(h, rt.event_record, "cudaEventRecord");
    load(h, rt.event_synchronize, "cudaEventSynchronize");
    load(h, rt.event_query, "cudaEventQuery");
    load(h, rt.memcpy_async, "cudaMemcpyAsync");
    load(h, rt.get_last_error, "cudaGetLastError");
    load(h, rt.get_error_string, "cudaGetErrorString");
    rt.copies = rt.get_device_count && rt.get_device && rt.set_device && rt.stream_create && rt.stream_destroy &&
                rt.stream_synchronize && rt.stream_wait_event && rt.event_create && rt.event_destroy && rt.event_record &&
                rt.event_synchronize && rt.event_query && rt.memcpy_async && rt.get_last_error && rt.get_error_string;
  });
  return rt;
}

// The error of a failed runtime call, which is also cleared so that it is not
// reported again by the next call (sticky errors stay: the context is lost).
Error cuda_error(const CudaRuntime& rt, const char* call, int code) {
  const char* what = rt.get_error_string ? rt.get_error_string(code) : nullptr;
  if (rt.get_last_error) (void)rt.get_last_error();
  return Error{ErrorKind::kIo, fmt::format("{} failed: {} (CUDA error {})", call, what ? what : "unknown error", code)};
}

// Makes `device` current on this thread for one scope and restores the
// caller's device afterwards: PyTorch and the caller keep their own.
class DeviceScope {
 public:
  DeviceScope(const CudaRuntime& rt, int device) : rt_(rt) {
    if (rt.get_device(&previous_) != 0) {
      (void)rt.get_last_error();
      previous_ = -1;
    }
    if (previous_ != device) {
      const int rc = rt.set_device(device);
      if (rc != 0) error_ = cuda_error(rt, "cudaSetDevice", rc);
      changed_ = rc == 0;
    }
  }
  ~DeviceScope() {
    if (changed_ && previous_ >= 0) (void)rt_.set_device(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const std::optional<Error>& error() const { return error_; }

 private:
  const CudaRuntime& rt_;
  int previous_ = -1;
  bool changed_ = false;
  std::optional<Error> error_;
};

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

bool pin_host_memory(void* ptr, std::size_t bytes, int device) {
  const auto& rt = runtime();
  if (!rt.host_register) return false;
  std::optional<DeviceScope> scope;
  if (device >= 0 && rt.copies) {
    scope.emplace(rt, device);
    if (scope->error()) return false;
  }
  // Portable: pinned for every device's context, not only the current one.
  constexpr unsigned kHostRegisterPortable = 0x1;
  if (rt.host_register(ptr, bytes, kHostRegisterPortable) == 0) return true;
  if (rt.get_last_error) (void)rt.get_last_error();
  return false;
}

void unpin_host_memory(void* ptr) {
  const auto& rt = runtime();
  if (rt.host_unregister) rt.host_unregister(ptr);
}

Status cuda_runtime_loaded() {
  if (!runtime().handle) return Error{ErrorKind::kIo, fmt::format("no CUDA runtime could be loaded (tried {})", runtime().tried)};
  return {};
}

Status cuda_device_usable(int device) {
  const auto& rt = runtime();
  if (Status s = cuda_runtime_loaded(); !s) return s;
  if (!rt.copies) return Error{ErrorKind::kIo, "the CUDA runtime lacks the stream and copy functions (too old?)"};
  if (device < 0) return Error{ErrorKind::kUsage, fmt::format("CUDA device {} is not a device ordinal", device)};
  int count = 0;
  if (const int rc = rt.get_device_count(&count); rc != 0) return cuda_error(rt, "cudaGetDeviceCount", rc);
  if (device >= count)
    return Error{ErrorKind::kUsage, fmt::format("there is no CUDA device {}: this machine has {}", device, count)};
  return {};
}

void* cuda_runtime_symbol(const char* name) {
  const auto& rt = runtime();
  return rt.handle ? ::dlsym(rt.handle, name) : nullptr;
}

DeviceToHost::~DeviceToHost() {
  const auto& rt = runtime();
  for (auto& [device, s] : sides_) {
    DeviceScope scope(rt, device);
    if (scope.error()) continue;
    // Copies still queued (a failed save) must not land in freed memory.
    if (s.queued) (void)rt.stream_synchronize(s.stream);
    if (s.event) (void)rt.event_destroy(s.event);
    if (s.stream) (void)rt.stream_destroy(s.stream);
  }
}

Expected<DeviceToHost::Side*> DeviceToHost::side(int device) {
  if (auto it = sides_.find(device); it != sides_.end()) return &it->second;
  if (Status st = cuda_device_usable(device); !st) return st.error();
  const auto& rt = runtime();
  Side s;
  if (const int rc = rt.stream_create(&s.stream, kStreamNonBlocking); rc != 0) return cuda_error(rt, "cudaStreamCreateWithFlags", rc);
  if (const int rc = rt.event_create(&s.event, kEventDisableTiming); rc != 0) {
    (void)rt.stream_destroy(s.stream);
    return cuda_error(rt, "cudaEventCreateWithFlags", rc);
  }
  return &(sides_[device] = s);
}

Status DeviceToHost::order_after(int device, std::uintptr_t producer_stream) {
  const auto& rt = runtime();
  if (!rt.copies) return cuda_device_usable(device);
  DeviceScope scope(rt, device);
  if (scope.error()) return *scope.error();
  auto s = side(device);
  if (!s) return s.error();
  void* producer = reinterpret_cast<void*>(producer_stream);
  if (const int rc = rt.event_record((*s)->event, producer); rc != 0) return cuda_error(rt, "cudaEventRecord on the producer stream", rc);
  if (const int rc = rt.stream_wait_event((*s)->stream, (*s)->event, 0); rc != 0) return cuda_error(rt, "cudaStreamWaitEvent", rc);
  return {};
}

Status DeviceToHost::copy(int device, void* dst, const void* src, std::size_t bytes) {
  const auto& rt = runtime();
  if (!rt.copies) return cuda_device_usable(device);
  DeviceScope scope(rt, device);
  if (scope.error()) return *scope.error();
  auto s = side(device);
  if (!s) return s.error();
  (*s)->queued = true;
  if (const int rc = rt.memcpy_async(dst, src, bytes, kMemcpyDeviceToHost, (*s)->stream); rc != 0)
    return cuda_error(rt, "cudaMemcpyAsync (device to host)", rc);
  return {};
}

CopyFence::~CopyFence() {
  const auto& rt = runtime();
  for (auto& [device, event] : events_) (void)rt.event_destroy(event);
}

Status CopyFence::wait() const {
  const auto& rt = runtime();
  Status first;
  for (const auto& [device, event] : events_) {
    const int rc = rt.event_synchronize(event);
    if (rc != 0 && first) first = cuda_error(rt, "cudaEventSynchronize on the device-to-host copies", rc);
  }
  return first;
}

Status CopyFence::order_before(std::uintptr_t stream) const {
  const auto& rt = runtime();
  for (const auto& [device, event] : events_) {
    // An event of another device may be waited for: the stream's own device stays current.
    if (const int rc = rt.stream_wait_event(reinterpret_cast<void*>(stream), event, 0); rc != 0)
      return cuda_error(rt, "cudaStreamWaitEvent (the caller's stream after the device-to-host copies)", rc);
  }
  return {};
}

bool CopyFence::done() const {
  const auto& rt = runtime();
  for (const auto& [device, event] : events_) {
    if (rt.event_query(event) != 0) {
      (void)rt.get_last_error();  // cudaErrorNotReady is not an error to keep
      return false;
    }
  }
  return true;
}

Expected<std::shared_ptr<CopyFence>> DeviceToHost::fence() {
  std::shared_ptr<CopyFence> f(new CopyFence());
  const auto& rt = runtime();
  for (auto& [device, s] : sides_) {
    if (!s.queued) continue;
    DeviceScope scope(rt, device);
    if (scope.error()) return *scope.error();
    void* event = nullptr;
    if (const int rc = rt.event_create(&event, kEventDisableTiming); rc != 0) return cuda_error(rt, "cudaEventCreateWithFlags", rc);
    f->events_.emplace_back(device, event);  // destroyed with the fence, also on the error below
    if (const int rc = rt.event_record(event, s.stream); rc != 0) return cuda_error(rt, "cudaEventRecord on the copy stream", rc);
  }
  return f;
}

Status DeviceToHost::synchronize() {
  const auto& rt = runtime();
  Status first;
  for (auto& [device, s] : sides_) {
    if (!s.queued) continue;
    DeviceScope scope(rt, device);
    if (scope.error()) {
      if (first) first = *scope.error();
      continue;
    }
    const int rc = rt.stream_synchronize(s.stream);
    s.queued = false;
    if (rc != 0 && first) first = cuda_error(rt, "cudaStreamSynchronize", rc);
  }
  return first;
}

}  // namespace pacer::hw
