// RoPE tables for DeepSeek-V2/V3 checkpoints: plain or YaRN-scaled inverse frequencies, with
// YaRN's cos/sin magnitude factor folded in. Pairs are interleaved (x[2i], x[2i+1]).
#pragma once

#include <vector>

#include "config/model_config.h"

namespace moat {

// inv_freq[rope_dim / 2]
std::vector<float> rope_inv_freq(const ModelConfig& config);

struct RopeTable {
  int64_t max_positions = 0;
  int64_t half_dim = 0;
  std::vector<float> cos;  // [max_positions, half_dim]
  std::vector<float> sin;  // [max_positions, half_dim]
};

RopeTable build_rope_table(const ModelConfig& config, int64_t max_positions);

}  // namespace moat
