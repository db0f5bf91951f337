// Internal: robust statistics shared by the per-node (cluster) and per-GPU (one node) outlier judgements.
#pragma once

#include <vector>

#include "pacer/vet/check.hpp"
#include "pacer/vet/profile.hpp"

namespace pacer::vet {

// median, MAD and the spread z is measured in: max(1.4826 MAD, floor * |median|).
struct RobustScale {
  double median = 0;
  double mad = 0;
  double sigma = 0;
};
RobustScale robust_scale(const std::vector<double>& values, double floor);

// Per-GPU throughput checks (higher is better, targets gpu0..gpuN) of one
// node: a GPU far below the node's other GPUs of the same check warns or
// fails by the profile's outlier settings, even when it passes the absolute
// thresholds. Needs at least `outlier_min_nodes` GPUs with a figure.
void judge_gpu_outliers(std::vector<CheckResult>& checks, const ClusterConfig& cfg);

}  // namespace pacer::vet
