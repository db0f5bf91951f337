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

}  // namespace pacer::hw
