// Active GPU measurements (CUDA): GEMM throughput with a result check, HBM bandwidth, memory test, host transfers,
// sustained load, peer-to-peer and NCCL all-reduce. Built when nvcc is found; otherwise every call says so.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::hw::gpu {

// True when this build has the CUDA code; false in builds without nvcc, where
// every call below returns an Error saying so.
bool built_with_cuda();

// CUDA devices visible to this process (cudaGetDeviceCount); an Error when the
// driver or a device is missing, naming the CUDA error.
Expected<int> device_count();

enum class Precision { kBf16, kFp16, kTf32, kFp64 };
inline const char* to_string(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kTf32: return "tf32";
    case Precision::kFp64: return "fp64";
  }
  return "?";
}

struct GemmOptions {
  int m = 8192, n = 8192, k = 8192;
  double seconds = 1.0;  // timed time at least, after warm-up
  int samples = 64;      // entries checked against the fp64 reference
  std::uint64_t seed = 1;
};

struct GemmResult {
  double tflops = 0;           // 2mnk per GEMM over the median time of timed batches
  int checked = 0;             // entries compared with the fp64 reference
  int wrong = 0;               // entries off by more than the precision allows
  double worst_error = 0;      // largest |c - ref| / sum|a||b| seen
  double tolerance = 0;        // allowed |c - ref| / sum|a||b| for this precision
  std::string algorithm;       // which cuBLASLt heuristic result was fastest
};

// C = A·B through cuBLASLt (loaded with dlopen) on random inputs (never
// zeros): inputs and output in the precision (tf32: fp32 storage, TF32 tensor
// cores; fp64: DGEMM), fp32 accumulation for the 16-bit types. The fastest of
// the heuristic's top algorithms is timed; sampled entries of C are checked
// against an fp64 dot product on the device (silent data corruption shows
// up as `wrong` > 0).
Expected<GemmResult> gemm(int device, Precision p, const GemmOptions& o);

// Read+write bandwidth of a copy kernel over `bytes` (counted twice per pass,
// as torch's copy_ is), median of `passes`, in GB/s.
Expected<double> hbm_bandwidth(int device, std::uint64_t bytes, int passes);

struct MemtestResult {
  std::uint64_t bytes = 0;   // tested
  std::uint64_t errors = 0;  // 32-bit words that read back wrong
  std::string first;         // the first bad word: offset, wrote, read
};
// Writes address-derived patterns (and their inverse) over `fraction` of the
// free device memory and reads them back.
Expected<MemtestResult> memtest(int device, double fraction);

struct TransferResult {
  double h2d_pinned = 0, d2h_pinned = 0, h2d_pageable = 0, d2h_pageable = 0;  // GB/s, median of passes
};
Expected<TransferResult> host_transfer(int device, std::uint64_t bytes, int passes);

// One sample of the device while load runs, from the caller's watcher.
struct LoadTick {
  double elapsed_s = 0;
  double tflops = 0;  // of the GEMMs finished since the previous tick
};
// bf16 GEMMs back to back for `seconds`; `on_tick` is called about every
// `tick_s` from the calling thread (the watcher samples NVML there).
Expected<std::vector<LoadTick>> sustained_gemm(int device, double seconds, double tick_s, int size,
                                               const std::function<void(const LoadTick&)>& on_tick);

struct PeerResult {
  int from = 0, to = 0;
  double gb_per_s = 0;  // cudaMemcpyPeer, median of passes
  bool peer_access = false;
};
// Every ordered pair of visible devices; an empty vector with one device.
Expected<std::vector<PeerResult>> peer_bandwidth(std::uint64_t bytes, int passes);

struct AllReduceResult {
  int devices = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;  // median
  double algbw = 0;    // bytes / seconds, GB/s
  double busbw = 0;    // algbw * 2(n-1)/n, as nccl-tests defines it
  bool correct = false;
  std::string nccl_version;
};
// This process's part of an all-reduce across processes, one per node: its
// GPUs are ranks node*G .. node*G+G-1 of nodes*G (every node has G GPUs).
struct NcclPeers {
  std::string unique_id;  // from nccl_unique_id() on one process, passed to all
  int node = 0;
  int nodes = 1;
};
// An NCCL unique id (its 128 bytes) for NcclPeers.
Expected<std::string> nccl_unique_id();
// fp32 sum all-reduce of `bytes` per device over all visible devices, one
// process driving them (ncclCommInitAll), or over every node's devices with
// `peers` (every process must call it, or the others wait in NCCL's init).
// `devices` in the result is the total rank count. libnccl.so.2 is loaded
// with dlopen.
Expected<AllReduceResult> nccl_all_reduce(std::uint64_t bytes, int passes, const NcclPeers* peers = nullptr);

}  // namespace pacer::hw::gpu
