// Versions of the run-time libraries a training job depends on (NCCL, MPI, CUDA toolkit).
#pragma once

#include <string>

namespace pacer::hw {

// Each returns an empty string when the library cannot be found. The libraries
// are loaded with dlopen and unloaded again; nothing is initialised.
std::string nccl_version();         // "2.27.3", from ncclGetVersion
std::string mpi_library_version();  // first line of MPI_Get_library_version
std::string cuda_toolkit_version(); // from $CUDA_HOME or /usr/local/cuda version.json
std::string glibc_version();

// The NCCL library every part of pacer uses (vet's version and bandwidth
// checks, the comm backend): $PACER_NCCL_LIBRARY when set (PyTorch wheels
// carry their own; a path that does not load is an error, not replaced by
// another NCCL), else libnccl.so.2 on the loader's path or in the CUDA
// toolkit. nullptr when none loads; `tried` then says what was attempted.
void* open_nccl_library(std::string* tried = nullptr);
// "2.28.9" from ncclGetVersion's code (releases before 2.9 counted in 1000s).
std::string nccl_version_text(int code);

}  // namespace pacer::hw
