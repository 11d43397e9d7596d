// What the op parity tests share: the error measure they hold kernels to, their random inputs, and
// the kernels of the host backends a shape runs on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

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
