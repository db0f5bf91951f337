// Page-locking host memory through the CUDA runtime, loaded with dlopen when present.
#pragma once

#include <cstddef>

namespace pacer::hw {

// Registers [ptr, ptr+bytes) with cudaHostRegister so device copies from it run
// at full speed. Returns false (and does nothing) when no CUDA runtime or GPU
// is available. Thread-safe.
bool pin_host_memory(void* ptr, std::size_t bytes);
void unpin_host_memory(void* ptr);

}  // namespace pacer::hw
