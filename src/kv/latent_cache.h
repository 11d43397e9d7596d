// One sequence's MLA cache: per layer, per token, the normed latent (kv_lora_rank values) and the
// roped shared key (qk_rope_head_dim values). 576 values per token per layer for DeepSeek-V3,
// instead of 2 x heads x head_dim for an expanded K/V cache. Contiguous per sequence for now;
// the paged pool (blocks + radix prefix cache) replaces this behind the same row() access.
#pragma once

#include <cstdint>

#include "base/check.h"
#include "base/tensor.h"

namespace moat {

class LatentCache {
 public:
  LatentCache(int64_t num_layers, int64_t capacity, int64_t dim)
      : num_layers_(num_layers), capacity_(capacity), dim_(dim),
        storage_(static_cast<size_t>(num_layers * capacity * dim)) {}

  // [capacity, dim] for one layer
  float* layer(int64_t index) { return storage_.data() + index * capacity_ * dim_; }
  float* row(int64_t layer_index, int64_t pos) {
    MOAT_CHECK(pos >= 0 && pos < capacity_, "cache position {} outside capacity {}", pos, capacity_);
    return layer(layer_index) + pos * dim_;
  }
  int64_t capacity() const { return capacity_; }
  int64_t dim() const { return dim_; }
  int64_t bytes() const { return num_layers_ * capacity_ * dim_ * static_cast<int64_t>(sizeof(float)); }

 private:
  int64_t num_layers_, capacity_, dim_;
  Buffer storage_;  // [num_layers, capacity, dim]
};

}  // namespace moat
