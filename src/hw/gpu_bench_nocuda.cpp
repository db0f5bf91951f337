// Builds without nvcc: the active GPU measurements exist as calls that say why they cannot run.
#include "pacer/hw/gpu_bench.hpp"

namespace pacer::hw::gpu {
namespace {
Error no_cuda() { return Error{ErrorKind::kRuntime, "pacer was built without CUDA (nvcc not found at build time)"}; }
}  // namespace

bool built_with_cuda() { return false; }

Expected<int> device_count() { return no_cuda(); }
Expected<GemmResult> gemm(int, Precision, const GemmOptions&) { return no_cuda(); }
Expected<double> hbm_bandwidth(int, std::uint64_t, int) { return no_cuda(); }
Expected<MemtestResult> memtest(int, double) { return no_cuda(); }
Expected<TransferResult> host_transfer(int, std::uint64_t, int) { return no_cuda(); }
Expected<std::vector<LoadTick>> sustained_gemm(int, double, double, int, const std::function<void(const LoadTick&)>&) { return no_cuda(); }
Expected<std::vector<PeerResult>> peer_bandwidth(std::uint64_t, int) { return no_cuda(); }
Expected<std::string> nccl_unique_id() { return no_cuda(); }
Expected<AllReduceResult> nccl_all_reduce(std::uint64_t, int, const NcclPeers*) { return no_cuda(); }

}  // namespace pacer::hw::gpu
