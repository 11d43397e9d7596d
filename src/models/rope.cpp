#include "models/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace moat {

std::vector<float> rope_inv_freq(const ModelConfig& config) {
  const int64_t dim = config.qk_rope_head_dim;
  const int64_t half = dim / 2;
  const double base = config.rope_theta;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  if (!config.rope_scaling || config.rope_scaling->factor <= 1.0) return inv_freq;

  // YaRN: dimensions that rotate fewer than beta_slow times over the original context are
  // interpolated (divided by factor); those rotating more than beta_fast times are kept; a
  // linear ramp blends the band between.
  const RopeScaling& s = *config.rope_scaling;
  auto correction_dim = [&](double num_rotations) {
    return (static_cast<double>(dim) *
            std::log(static_cast<double>(s.original_max_position_embeddings) /
                     (num_rotations * 2.0 * std::numbers::pi))) /
           (2.0 * std::log(base));
  };
  const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const float extra = inv_freq[i];
    const float inter = extra / static_cast<float>(s.factor);
    const float ramp = static_cast<float>(std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0));
    const float extra_weight = 1.0f - ramp;
    inv_freq[i] = inter * (1.0f - extra_weight) + extra * extra_weight;
  }
  return inv_freq;
}

RopeTable build_rope_table(const ModelConfig& config, int64_t max_positions) {
  RopeTable table;
  table.max_positions = max_positions;
  table.half_dim = config.qk_rope_head_dim / 2;
  const std::vector<float> inv_freq = rope_inv_freq(config);
  float magnitude = 1.0f;
  if (config.rope_scaling && config.rope_scaling->factor > 1.0)
    magnitude = static_cast<float>(yarn_get_mscale(config.rope_scaling->factor, config.rope_scaling->mscale) /
                                   yarn_get_mscale(config.rope_scaling->factor, config.rope_scaling->mscale_all_dim));
  table.cos.resize(static_cast<size_t>(max_positions * table.half_dim));
  table.sin.resize(table.cos.size());
  for (int64_t p = 0; p < max_positions; ++p)
    for (int64_t i = 0; i < table.half_dim; ++i) {
      const float angle = static_cast<float>(p) * inv_freq[i];  // fp32, as the reference computes it
      table.cos[p * table.half_dim + i] = std::cos(angle) * magnitude;
      table.sin[p * table.half_dim + i] = std::sin(angle) * magnitude;
    }
  return table;
}

}  // namespace moat
