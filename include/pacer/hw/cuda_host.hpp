// The CUDA runtime, loaded with dlopen when present: page-locking host memory and copying device memory to the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::hw {

// Registers [ptr, ptr+bytes) with cudaHostRegister (portable: for every
// device) so device copies from it run at full speed and asynchronously.
// `device` >= 0: registered from that device's context, so that a process
// that uses only device 3 does not create a context on device 0; -1: the
// current device. Returns false (and does nothing) when no CUDA runtime or GPU
// is available. Thread-safe.
bool pin_host_memory(void* ptr, std::size_t bytes, int device = -1);
void unpin_host_memory(void* ptr);

// Ok when `device` is a CUDA device ordinal of this machine and the runtime
// has what DeviceToHost needs; otherwise why not: no runtime (naming the
// libraries tried), no device, or fewer devices than `device + 1`.
// Thread-safe.
Status cuda_device_usable(int device);

// The runtime's symbol `name` (cudaMalloc, ...), from the same runtime every
// function here uses: the libcudart already in the process (PyTorch's) when
// there is one, so pointers, streams and the current device agree with it.
// nullptr without a runtime or such a symbol. For comm's NCCL backend, tests
// and tools.
void* cuda_runtime_symbol(const char* name);
// Ok when that runtime loaded; otherwise an error naming the libraries tried.
Status cuda_runtime_loaded();

// Copies from CUDA device memory into host memory on one non-blocking side
// stream per device, created on first use and kept until destruction, so that
// the copies never wait for unrelated work on the caller's streams (only for
// what order_after() names). Every call sets the calling thread's current
// device for itself and restores it before returning. Not thread-safe: one
// owner. Errors name the CUDA call and the runtime's message.
class DeviceToHost;

// The point that the side streams' copies had reached when DeviceToHost::fence()
// was called. The host can wait for it (the writer, before it reads the
// staged bytes) and a stream can be made to wait for it on the device (the
// training loop's, before it overwrites the source tensors), so that neither
// blocks the thread that queued the copies. Thread-safe; destroys its events.
class CopyFence {
 public:
  ~CopyFence();
  CopyFence(const CopyFence&) = delete;
  CopyFence& operator=(const CopyFence&) = delete;
  // Blocks until every copy before the fence has landed; the first error of a copy.
  Status wait() const;
  // Work queued on `stream` (a cudaStream_t of any device; 0: the legacy
  // default stream) after this call starts only once those copies have
  // finished reading their sources. Does not block the host.
  Status order_before(std::uintptr_t stream) const;
  // Whether every copy has landed (does not block).
  bool done() const;

 private:
  friend class DeviceToHost;
  CopyFence() = default;
  std::vector<std::pair<int, void*>> events_;  // device, cudaEvent_t
};

class DeviceToHost {
 public:
  DeviceToHost() = default;
  ~DeviceToHost();
  DeviceToHost(const DeviceToHost&) = delete;
  DeviceToHost& operator=(const DeviceToHost&) = delete;

  // Copies queued on `device` after this call start only once the work queued
  // so far on `producer_stream` (a cudaStream_t of that device; 0: the legacy
  // default stream) has finished. Does not block the host.
  Status order_after(int device, std::uintptr_t producer_stream);
  // Queues `bytes` from device memory `src` into host memory `dst`. With
  // page-locked `dst` the copy is asynchronous and `dst` must stay valid until
  // synchronize(); with pageable `dst` the runtime finishes it before returning.
  Status copy(int device, void* dst, const void* src, std::size_t bytes);
  // Blocks until every copy queued so far has landed in host memory.
  Status synchronize();
  // A fence after every copy queued so far (none queued: a fence that is
  // already passed). The copies stay queued: synchronize() still waits for them.
  Expected<std::shared_ptr<CopyFence>> fence();

 private:
  struct Side {
    void* stream = nullptr;  // cudaStream_t
    void* event = nullptr;   // cudaEvent_t: the producer stream's position
    bool queued = false;     // copies queued since the last synchronize()
  };
  Expected<Side*> side(int device);
  std::map<int, Side> sides_;
};

}  // namespace pacer::hw
