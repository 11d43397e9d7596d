// Scalar reference kernels of Kimi K3's ops (situ_mul, sigmoid_mul, attn_res_mix): the oracle the
// cpu and cuda kernels are tested against and the cpu backend's declared fallback. Everything is
// computed in double and rounded once. register_reference_kernels() calls
// register_reference_k3_kernels() last.
#include <algorithm>
#include <cmath>
#include <vector>

#include "base/check.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

namespace moat::ops {
namespace {

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void situ_mul_ref(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta, float* y) {
  const double b = beta, lb = linear_beta;
  for (int64_t i = 0; i < T * n; ++i) {  // y may alias gate: gate[i] is read before y[i] is written
    const double g = gate[i], u = up[i];
    y[i] = static_cast<float>(b * std::tanh(g / b) * sigmoid_d(g) * (lb * std::tanh(u / lb)));
  }
}

void sigmoid_mul_ref(const float* x, const float* gate, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(static_cast<double>(x[i]) * sigmoid_d(gate[i]));
}

void attn_res_mix_ref(const AttnResMixArgs& a) {
  const int64_t R = a.num_rows, D = a.dim;
  MOAT_CHECK(R >= 1, "attn_res_mix needs at least one row, got {}", R);
  std::vector<double> p(static_cast<size_t>(R));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      const float* x = a.rows[r] + t * D;  // [D]
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        ss += static_cast<double>(x[d]) * x[d];
        dot += static_cast<double>(x[d]) * a.weight[d];
      }
      p[r] = dot / std::sqrt(ss / static_cast<double>(D) + a.eps);
    }
    const double m = *std::max_element(p.begin(), p.end());
    double sum = 0.0;
    for (double& v : p) sum += (v = std::exp(v - m));
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0.0;
      for (int64_t r = 0; r < R; ++r) acc += p[r] * a.rows[r][t * D + d];
      a.out[t * D + d] = static_cast<float>(acc / sum);
    }
  }
}

}  // namespace

void register_reference_k3_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn) {
    r.add(KernelEntry{op, Backend::reference, name, fn, {}, 0, {Backend::cpu}});
  };
  add(OpId::situ_mul, "reference.situ_mul", reinterpret_cast<void*>(&situ_mul_ref));
  add(OpId::sigmoid_mul, "reference.sigmoid_mul", reinterpret_cast<void*>(&sigmoid_mul_ref));
  add(OpId::attn_res_mix, "reference.attn_res_mix", reinterpret_cast<void*>(&attn_res_mix_ref));
}

}  // namespace moat::ops
