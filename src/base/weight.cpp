#include "base/weight.h"

#include "base/check.h"

namespace moat {

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
    default: MOAT_CHECK(false, "unsupported weight dtype {}", dtype_name(dtype));
  }
  return 0.0f;
}

WeightMatrix WeightMatrix::rows(int64_t row_begin, int64_t num_rows) const {
  MOAT_CHECK(row_begin >= 0 && row_begin + num_rows <= out_features);
  WeightMatrix w = *this;
  w.out_features = num_rows;
  w.data = static_cast<const uint8_t*>(data) + row_begin * in_features * dtype_size(dtype);
  if (dtype == DType::F8_E4M3) {
    MOAT_CHECK(row_begin % block_out == 0, "fp8 row slice at {} not aligned to {}", row_begin,
               block_out);
    w.scale_inv = scale_inv + (row_begin / block_out) * scale_cols();
  }
  return w;
}

}  // namespace moat
