// NCCL all-reduce across nodes: the interface the cluster vet calls; the CUDA build provides the measurement.
#include "cluster_nccl.hpp"

namespace pacer::vet {

AllReduceResult nccl_allreduce_across_nodes(comm::TimedComm& leaders, std::size_t bytes, comm::Deadline) {
  AllReduceResult r;
  r.bytes = bytes;
  r.ranks = leaders.size();
  r.status = CheckStatus::kSkip;
#ifdef PACER_HAVE_CUDA
  r.reason = "NCCL all-reduce across nodes is not measured by this build yet";
#else
  r.reason = "pacer was built without CUDA";
#endif
  return r;
}

}  // namespace pacer::vet
