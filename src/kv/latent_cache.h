// The paged MLA latent cache: per layer, per token slot, the normed latent (kv_lora_rank values)
// and the roped shared key (qk_rope_head_dim values): 576 values per token per layer for
// DeepSeek-V3, instead of 2 x heads x head_dim for an expanded K/V cache. Slots are grouped in
// blocks (kv/block_pool.h hands them out); block b holds slots [b * block_size, (b+1) * block_size)
// of every layer. Stored in bf16 by default (the model computes in fp32 and store_latent rounds),
// or fp8 e4m3 with one fp32 scale per row, or fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "kv/state_pool.h"
#include "ops/kernel_types.h"

namespace moat {

struct LatentCacheShape {
  int64_t num_layers = 0, dim = 0;  // dim = kv_lora_rank + qk_rope_head_dim
  DType dtype = DType::BF16;

  // Bytes one token takes across all layers (fp8 includes its row scale).
  int64_t bytes_per_token() const;
};

// "bf16" / "fp8" / "fp32" (also the dtype names "BF16", "F8_E4M3", "F32").
Result<DType> parse_kv_dtype(std::string_view name);

class PagedLatentCache {
 public:
  // Reserves address space for num_blocks blocks; pages are backed by memory as they are written.
  PagedLatentCache(const LatentCacheShape& shape, int32_t num_blocks, int32_t block_size);
  ~PagedLatentCache();
  PagedLatentCache(const PagedLatentCache&) = delete;
  PagedLatentCache& operator=(const PagedLatentCache&) = delete;

  const LatentCacheShape& shape() const { return shape_; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  int64_t bytes() const { return bytes_; }
  // Unique per cache made in this process (tensor-parallel workers mirror rank 0's caches by it).
  uint64_t id() const { return id_; }
  // Layer `layer`'s rows for the attention and store ops.
  ops::LatentPages layer(int64_t layer) const;
  // One row as fp32 (tests and debugging).
  std::vector<float> read_row(int64_t layer, int64_t slot) const;

 private:
  LatentCacheShape shape_;
  int32_t num_blocks_, block_size_;
  int64_t slots_, row_bytes_;
  int64_t bytes_ = 0;
  uint64_t id_ = 0;
  uint8_t* base_ = nullptr;  // [num_layers] x ([slots, dim] rows, then [slots] fp32 scales for fp8)
};

// One sequence's cache of up to `capacity` tokens in blocks 0, 1, ... (no pool, no sharing):
// for scoring, tests and single-stream benchmarks. Models with recurrent state (Kimi Linear)
// get the sequence's one state slot beside it.
struct SequenceCache {
  SequenceCache(const LatentCacheShape& shape, int64_t capacity, int32_t block_size, int64_t state_bytes = 0)
      : pages(shape, static_cast<int32_t>((capacity + block_size - 1) / block_size), block_size),
        states(state_bytes > 0 ? 1 : 0, state_bytes) {
    for (int32_t b = 0; b < pages.num_blocks(); ++b) blocks.push_back(b);
    if (states.enabled()) state_slot = *states.allocate();
  }
  PagedLatentCache pages;
  std::vector<int32_t> blocks;
  StateSlotPool states;
  int32_t state_slot = -1;
};

}  // namespace moat
