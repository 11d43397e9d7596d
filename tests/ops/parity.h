// What the op parity tests share: the error measure they hold kernels to and their random inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace moat::ops::testing {

// max |out - ref| / max |ref| (the absolute difference when ref is all zero); a NaN on one side
// only is an infinite error.
inline double normalized_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return INFINITY;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(out[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

inline std::vector<float> randn(size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace moat::ops::testing
