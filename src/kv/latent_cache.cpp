#include "kv/latent_cache.h"

#include <atomic>

#include <sys/mman.h>

#include "base/check.h"

namespace moat {

namespace {
int64_t scale_bytes(DType dtype) { return dtype == DType::F8_E4M3 ? static_cast<int64_t>(sizeof(float)) : 0; }
}  // namespace

int64_t LatentCacheShape::bytes_per_token() const {
  return num_layers * (dim * static_cast<int64_t>(dtype_size(dtype)) + scale_bytes(dtype));
}

Result<DType> parse_kv_dtype(std::string_view name) {
  if (name == "bf16" || name == "BF16" || name == "auto") return DType::BF16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "F8_E4M3") return DType::F8_E4M3;
  if (name == "fp32" || name == "F32") return DType::F32;
  return make_error("--kv-dtype '{}': expected bf16, fp8 or fp32", name);
}

PagedLatentCache::PagedLatentCache(const LatentCacheShape& shape, int32_t num_blocks, int32_t block_size)
    : shape_(shape), num_blocks_(num_blocks), block_size_(block_size) {
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id.fetch_add(1);
  MOAT_CHECK(shape.dtype == DType::BF16 || shape.dtype == DType::F32 || shape.dtype == DType::F8_E4M3,
             "latent cache dtype {} not supported", dtype_name(shape.dtype));
  slots_ = static_cast<int64_t>(num_blocks) * block_size;
  row_bytes_ = shape.dim * static_cast<int64_t>(dtype_size(shape.dtype));
  // Each layer's region starts on a 64-byte boundary so vector loads of row 0 are aligned.
  const int64_t layer_bytes = (slots_ * (row_bytes_ + scale_bytes(shape.dtype)) + 63) / 64 * 64;
  bytes_ = layer_bytes * shape.num_layers;
  // Anonymous mapping: untouched blocks cost no memory, and the kernel zero-fills on first touch.
  void* p = mmap(nullptr, static_cast<size_t>(std::max<int64_t>(bytes_, 1)), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  MOAT_CHECK(p != MAP_FAILED, "cannot map {} bytes for the latent cache", bytes_);
  madvise(p, static_cast<size_t>(bytes_), MADV_HUGEPAGE);
  base_ = static_cast<uint8_t*>(p);
}

PagedLatentCache::~PagedLatentCache() {
  if (base_) munmap(base_, static_cast<size_t>(std::max<int64_t>(bytes_, 1)));
}

ops::LatentPages PagedLatentCache::layer(int64_t layer) const {
  MOAT_CHECK(layer >= 0 && layer < shape_.num_layers, "layer {} outside {}", layer, shape_.num_layers);
  uint8_t* l = base_ + layer * (bytes_ / shape_.num_layers);
  ops::LatentPages pages;
  pages.rows = l;
  pages.row_scale = shape_.dtype == DType::F8_E4M3 ? reinterpret_cast<float*>(l + slots_ * row_bytes_) : nullptr;
  pages.dtype = shape_.dtype;
  pages.block_size = block_size_;
  return pages;
}

std::vector<float> PagedLatentCache::read_row(int64_t layer_index, int64_t slot) const {
  MOAT_CHECK(slot >= 0 && slot < slots_, "slot {} outside {}", slot, slots_);
  const ops::LatentPages p = layer(layer_index);
  std::vector<float> out(static_cast<size_t>(shape_.dim));
  for (int64_t d = 0; d < shape_.dim; ++d) {
    switch (shape_.dtype) {
      case DType::F32: out[d] = static_cast<const float*>(p.rows)[slot * shape_.dim + d]; break;
      case DType::BF16: out[d] = bf16_to_f32(static_cast<const uint16_t*>(p.rows)[slot * shape_.dim + d]); break;
      default:
        out[d] = fp8_e4m3_to_f32(static_cast<const uint8_t*>(p.rows)[slot * shape_.dim + d]) * p.row_scale[slot];
    }
  }
  return out;
}

}  // namespace moat
