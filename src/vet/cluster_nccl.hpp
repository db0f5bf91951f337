// Internal: NCCL all-reduce across nodes, bootstrapped through the node leaders' MPI communicator.
#pragma once

#include <cstddef>

#include "pacer/comm/timed.hpp"
#include "pacer/vet/cluster.hpp"

namespace pacer::vet {

// Every leader calls it with the same arguments, after the MPI all-reduce.
// Each leader drives all of its node's GPUs (ranks node*G .. node*G+G-1);
// the NCCL unique id travels from leader 0 over `leaders`. Skips with a
// reason where pacer was built without CUDA, no node has a GPU, or there is
// one node. The measurement runs in a child process killed at `deadline`;
// only leader 0's result is reported.
AllReduceResult nccl_allreduce_across_nodes(comm::TimedComm& leaders, std::size_t bytes, int passes, comm::Deadline deadline);

}  // namespace pacer::vet
