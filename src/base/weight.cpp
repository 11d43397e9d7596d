#include "base/weight.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "base/check.h"

namespace moat {

WeightMatrix WeightMatrix::packed_4bit(DType dtype, const void* packed, const void* scales, int64_t out,
                                       int64_t in) {
  MOAT_CHECK(dtype == DType::MXFP4 || dtype == DType::INT4_G32, "packed_4bit: dtype {}", dtype_name(dtype));
  MOAT_CHECK(in % kGroupSize == 0, "packed_4bit: in_features {} not a multiple of {}", in, kGroupSize);
  WeightMatrix w;
  w.dtype = dtype;
  w.data = packed;
  w.out_features = out;
  w.in_features = in;
  w.group_scales = scales;
  w.group_scale_kind = dtype == DType::MXFP4 ? GroupScaleKind::e8m0 : GroupScaleKind::bf16;
  return w;
}

float WeightMatrix::group_scale(int64_t row, int64_t group) const {
  const int64_t i = row * groups_per_row() + group;
  switch (group_scale_kind) {
    case GroupScaleKind::e8m0: return e8m0_to_f32(static_cast<const uint8_t*>(group_scales)[i]);
    case GroupScaleKind::bf16: return bf16_to_f32(static_cast<const uint16_t*>(group_scales)[i]);
    case GroupScaleKind::none: break;
  }
  MOAT_CHECK(false, "{} weight without group scales", dtype_name(dtype));
  return 0.0f;
}

float WeightMatrix::at(int64_t row, int64_t col) const {
  const int64_t i = row * in_features + col;
  switch (dtype) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::F8_E4M3: {
      const float q = fp8_e4m3_table()[static_cast<const uint8_t*>(data)[i]];
      return q * scale_inv[(row / block_out) * scale_cols() + col / block_in];
    }
    case DType::MXFP4:
    case DType::INT4_G32: {
      const uint8_t b = static_cast<const uint8_t*>(data)[row * packed_row_bytes() + col / 2];
      const int code = (col & 1) ? b >> 4 : b & 0xf;
      return int4_code_table(dtype)[code] * group_scale(row, col / kGroupSize);
    }
    default: MOAT_CHECK(false, "unsupported weight dtype {}", dtype_name(dtype));
  }
  return 0.0f;
}

WeightMatrix WeightMatrix::rows(int64_t row_begin, int64_t num_rows) const {
  MOAT_CHECK(row_begin >= 0 && row_begin + num_rows <= out_features);
  WeightMatrix w = *this;
  w.out_features = num_rows;
  if (is_4bit()) {
    w.data = static_cast<const uint8_t*>(data) + row_begin * packed_row_bytes();
    w.group_scales = static_cast<const uint8_t*>(group_scales) + row_begin * groups_per_row() * group_scale_bytes();
    return w;
  }
  w.data = static_cast<const uint8_t*>(data) + row_begin * in_features * dtype_size(dtype);
  if (dtype == DType::F8_E4M3) {
    MOAT_CHECK(row_begin % block_out == 0, "fp8 row slice at {} not aligned to {}", row_begin,
               block_out);
    w.scale_inv = scale_inv + (row_begin / block_out) * scale_cols();
  }
  return w;
}

Result<WeightMatrix> slice_rows(const WeightMatrix& w, int64_t row_begin, int64_t num_rows) {
  if (row_begin < 0 || num_rows <= 0 || row_begin + num_rows > w.out_features)
    return make_error("rows [{}, {}) outside a matrix of {} rows", row_begin, row_begin + num_rows, w.out_features);
  if (w.dtype == DType::F8_E4M3 && (row_begin % w.block_out != 0 ||
                                    (num_rows % w.block_out != 0 && row_begin + num_rows != w.out_features)))
    return make_error("{} rows per rank (from row {}) cut through the fp8 scale blocks of {} rows", num_rows, row_begin,
                      w.block_out);
  return w.rows(row_begin, num_rows);
}

Result<WeightMatrix> copy_columns(const WeightMatrix& w, int64_t col_begin, int64_t num_cols,
                                  OwnedWeightBytes& storage) {
  if (col_begin < 0 || num_cols <= 0 || col_begin + num_cols > w.in_features)
    return make_error("columns [{}, {}) outside a matrix of {} columns", col_begin, col_begin + num_cols,
                      w.in_features);
  WeightMatrix out = w;
  out.in_features = num_cols;
  const int64_t rows = w.out_features;
  if (w.is_4bit()) {
    if (col_begin % WeightMatrix::kGroupSize != 0 || num_cols % WeightMatrix::kGroupSize != 0)
      return make_error("{} columns per rank (from column {}) cut through the {}-column scale groups of {}", num_cols,
                        col_begin, WeightMatrix::kGroupSize, dtype_name(w.dtype));
    const int64_t row_bytes = num_cols / 2, groups = num_cols / WeightMatrix::kGroupSize;
    const int64_t scale_bytes = w.group_scale_bytes();
    storage.data.resize(static_cast<size_t>(rows * row_bytes));
    storage.group_scales.resize(static_cast<size_t>(rows * groups * scale_bytes));
    const auto* src = static_cast<const uint8_t*>(w.data);
    const auto* scales = static_cast<const uint8_t*>(w.group_scales);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(&storage.data[r * row_bytes], src + r * w.packed_row_bytes() + col_begin / 2, row_bytes);
      std::memcpy(&storage.group_scales[r * groups * scale_bytes],
                  scales + (r * w.groups_per_row() + col_begin / WeightMatrix::kGroupSize) * scale_bytes,
                  groups * scale_bytes);
    }
    out.data = storage.data.data();
    out.group_scales = storage.group_scales.data();
    return out;
  }
  const int64_t elem = static_cast<int64_t>(dtype_size(w.dtype));
  if (w.dtype == DType::F8_E4M3) {
    if (col_begin % w.block_in != 0 || (num_cols % w.block_in != 0 && col_begin + num_cols != w.in_features))
      return make_error("{} columns per rank (from column {}) cut through the fp8 scale blocks of {} columns",
                        num_cols, col_begin, w.block_in);
    const int64_t row_blocks = (rows + w.block_out - 1) / w.block_out;
    const int64_t cols = (num_cols + w.block_in - 1) / w.block_in;
    storage.scale_inv.resize(static_cast<size_t>(row_blocks * cols));
    for (int64_t b = 0; b < row_blocks; ++b)
      std::memcpy(&storage.scale_inv[b * cols], w.scale_inv + b * w.scale_cols() + col_begin / w.block_in,
                  sizeof(float) * cols);
    out.scale_inv = storage.scale_inv.data();
  }
  storage.data.resize(static_cast<size_t>(rows * num_cols * elem));
  const auto* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&storage.data[r * num_cols * elem], src + (r * w.in_features + col_begin) * elem, num_cols * elem);
  out.data = storage.data.data();
  return out;
}

int64_t realign_weights(const std::vector<WeightMatrix*>& matrices, HugePageBuffer& arena,
                        const std::function<void(const void*, size_t)>& release) {
  auto round_up = [](int64_t n) { return (n + static_cast<int64_t>(kWeightAlignment) - 1) / kWeightAlignment * kWeightAlignment; };
  // Each source once, by address (the largest extent any matrix reads from it), in first-use order.
  struct Source {
    int64_t bytes = 0, offset = 0;
    bool copied = false;
  };
  std::map<const void*, Source> sources;
  std::vector<const void*> order;
  auto note = [&](const void* p, int64_t bytes, bool even_if_aligned) {
    if (p == nullptr || bytes == 0 || (weight_aligned(p) && !even_if_aligned)) return;
    auto [it, added] = sources.try_emplace(p);
    if (added) order.push_back(p);
    it->second.bytes = std::max(it->second.bytes, bytes);
  };
  for (WeightMatrix* w : matrices) {
    if (w == nullptr) continue;
    note(w->data, w->data_bytes(), false);
    note(w->group_scales, w->group_scales_bytes(), false);
  }
  // A moved matrix takes its scales along, aligned or not: read where they are, they would map the
  // source's pages back in, a 2 MiB page of a huge-page mapped checkpoint per scale tensor touched
  // (the FP8 bench checkpoint's RSS grew from 1.07x to 1.85x the file over a prefill and decode,
  // its fp8 scale_inv tensors sitting between the moved codes).
  for (WeightMatrix* w : matrices) {
    if (w == nullptr || !sources.contains(w->data)) continue;
    note(w->group_scales, w->group_scales_bytes(), true);
    note(w->scale_inv, w->scale_inv_bytes(), true);
  }
  int64_t total = 0;
  for (const void* p : order) {
    sources[p].offset = total;
    total += round_up(sources[p].bytes);
  }
  if (total == 0) return 0;
  arena = HugePageBuffer(static_cast<size_t>(total));
  auto move = [&](const void*& p) {
    auto it = sources.find(p);
    if (it == sources.end()) return;
    Source& s = it->second;
    uint8_t* to = arena.data() + s.offset;
    if (!s.copied) {
      std::memcpy(to, p, static_cast<size_t>(s.bytes));
      if (release) release(p, static_cast<size_t>(s.bytes));
      s.copied = true;
    }
    p = to;
  };
  for (WeightMatrix* w : matrices) {
    if (w == nullptr) continue;
    move(w->data);
    move(w->group_scales);
    const void* scale_inv = w->scale_inv;
    move(scale_inv);
    w->scale_inv = static_cast<const float*>(scale_inv);
  }
  return total;
}

}  // namespace moat
