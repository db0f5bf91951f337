// Test helper: writes a realistic job catalog (2 nodes x 4 H200s, 8 ranks, 60 s at 1 Hz) for one workload shape.
#pragma once

#include <string>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::test {

// gemm, memory, input, comm, host, io, idle, cpu (no GPUs, CPU busy),
// cpu-contended (no GPUs, the command computes on a node others saturate),
// steps-only (no sampler: steps with data waits), steps-quiet (no sampler,
// steps that neither wait nor communicate), host-thread (GPUs mostly idle, one
// Python thread saturated), launch (kernels run 60% of the time on 4% of the
// SMs, the launching thread saturated), cpu-thread (no GPUs, one saturated
// thread), cpu-threads (no GPUs, eight busy threads), empty (a run and
// nothing else).
const std::vector<std::string>& synthetic_workloads();

// The verdict kind each workload must get.
std::string expected_verdict(const std::string& workload);

// Creates `path` (a new catalog) holding one run of `workload`.
Status write_synthetic_catalog(const std::string& path, const std::string& workload);

}  // namespace pacer::test
