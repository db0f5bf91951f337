// Internal: NCCL all-reduce across nodes, bootstrapped through the node leaders' MPI communicator.
#pragma once

#include <cstddef>

#include "pacer/comm/timed.hpp"
#include "pacer/vet/cluster.hpp"

namespace pacer::vet {

// Every leader calls it with the same arguments, after the MPI all-reduce.
// The NCCL unique id travels from leader 0 over `leaders`; one rank per GPU
// is not needed: each leader drives its node's GPUs. Returns skip where pacer
// was built without CUDA or the node has no GPU; only leader 0's result is
// reported. Must return by `deadline`.
AllReduceResult nccl_allreduce_across_nodes(comm::TimedComm& leaders, std::size_t bytes, comm::Deadline deadline);

}  // namespace pacer::vet
