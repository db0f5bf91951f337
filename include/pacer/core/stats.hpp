// Small statistics over measured samples.
#pragma once

#include <vector>

namespace pacer {

// The median of `values` (the mean of the two middle ones for an even count);
// 0 for none. Takes a copy, since it sorts.
double median(std::vector<double> values);

}  // namespace pacer
