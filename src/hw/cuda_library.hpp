// Internal to pacer::hw: finding a CUDA library (runtime, cuBLASLt, NCCL) to load with dlopen.
#pragma once

#include <initializer_list>
#include <string>

namespace pacer::hw {

// dlopen()s the first of `names` that loads, first through the loader's own
// search, then in $CUDA_HOME/lib64 and /usr/local/cuda/lib64 (toolkits are
// often not on the loader's path). nullptr when none loads; `tried` lists
// what was attempted, for error messages.
void* open_cuda_library(std::initializer_list<const char*> names, std::string* tried = nullptr);

}  // namespace pacer::hw
