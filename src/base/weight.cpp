#include "base/weight.h"

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

}  // namespace moat
