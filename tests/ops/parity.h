// What the op parity tests share: the error measure they hold kernels to, their random inputs, and
// the kernels of the host backends a shape runs on.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "base/weight.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

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

template <typename Fn>
Fn fn_of(const KernelEntry* k) {
  return reinterpret_cast<Fn>(k->fn);
}

// The products of matmul kernel k's group entry over `weights` (sharing x [T, in]) and of one call
// per weight: [0] grouped, [1] separate, one vector per weight, for the caller to compare.
inline std::array<std::vector<std::vector<float>>, 2> group_and_separate(const KernelEntry* k,
                                                                        const std::vector<float>& x, int64_t T,
                                                                        const std::vector<const WeightMatrix*>& weights,
                                                                        const MatmulPrecision& precision) {
  std::array<std::vector<std::vector<float>>, 2> out;
  std::vector<float*> ys;
  for (const WeightMatrix* w : weights) {
    for (auto& o : out) o.emplace_back(static_cast<size_t>(T * w->out_features), NAN);
    fn_of<MatmulFn>(k)(x.data(), T, *w, out[1].back().data(), precision);
    ys.push_back(out[0].back().data());
  }
  reinterpret_cast<MatmulGroupFn>(k->group_fn)(x.data(), T, weights.data(), ys.data(),
                                               static_cast<int64_t>(weights.size()), precision);
  return out;
}

// The AVX-512 BF16 matmul and its AMX twin (the same precision policy: x rounded to bf16 unless
// the precision splits it) are held to the same tolerances.
inline bool is_bf16_dot_matmul(const KernelEntry* k) {
  return k->name == "cpu.matmul_avx512bf16" || k->name == "cpu.matmul_amx_bf16";
}

// Kernels of the host backends (their memory is host memory) that accept `shape` on this CPU;
// the reference kernel is first. Reports the ones skipped.
inline std::vector<const KernelEntry*> host_kernels(OpId op, const OpShape& shape) {
  std::vector<const KernelEntry*> out;
  for (Backend b : {Backend::reference, Backend::cpu})
    for (const KernelEntry* k : Registry::global().kernels(op, b)) {
      auto reasons = k->constraints.check(shape);
      if (reasons.empty())
        out.push_back(k);
      else
        std::printf("  [not supported here] %s: %s\n", k->name.c_str(), reasons[0].c_str());
    }
  return out;
}

}  // namespace moat::ops::testing
