// Small statistics over measured samples.
#pragma once

#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer {

// The median of `values` (the mean of the two middle ones for an even count);
// 0 for none. Takes a copy, since it sorts.
double median(std::vector<double> values);

// Checkpoint interval that minimises lost work plus checkpoint cost, for a
// save that costs `save_cost_s` and a mean time between failures `mtbf_s`:
// Daly's higher-order estimate, sqrt(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ for
// δ < 2M, and M otherwise; 0 unless both are positive. Here in core because
// checkpoint and plan both need the one definition.
double optimal_interval(double save_cost_s, double mtbf_s);
// Young's first-order estimate, sqrt(2δM); 0 unless both are positive.
double young_interval(double save_cost_s, double mtbf_s);

// nccl-tests' bus-bandwidth factor for `collective` on n ranks (busbw =
// algbw x factor: what each link carries, so that one figure compares across
// collectives and rank counts): all_reduce 2(n-1)/n; reduce_scatter,
// all_gather, all_to_all (n-1)/n; broadcast 1. The names are the CLI's and
// JSON's. Here in core because hw (vet's NCCL check), vet's MPI check and
// comm bench need the one definition.
Expected<double> busbw_factor(std::string_view collective, int n);

}  // namespace pacer
