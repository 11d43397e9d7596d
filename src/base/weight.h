// A weight matrix exactly as the checkpoint stores it: [out_features, in_features] row-major, in
// bf16/f16/f32, or fp8 e4m3 with one fp32 scale per block_out x block_in tile
// (scale_inv: [ceil(out/block_out), ceil(in/block_in)]; W = Wq * scale_inv[i/bo][j/bi]).
// data points into the mmapped file: weights are never copied.
#pragma once

#include <cstdint>

#include "base/dtype.h"

namespace moat {

struct WeightMatrix {
  DType dtype = DType::BF16;
  const void* data = nullptr;
  int64_t out_features = 0;
  int64_t in_features = 0;
  const float* scale_inv = nullptr;  // only for F8_E4M3
  int64_t block_out = 128;
  int64_t block_in = 128;

  int64_t scale_cols() const { return (in_features + block_in - 1) / block_in; }
  // Bytes a matrix-vector product streams from memory (weights and scales).
  int64_t bytes() const {
    int64_t b = out_features * in_features * static_cast<int64_t>(dtype_size(dtype));
    if (scale_inv) b += ((out_features + block_out - 1) / block_out) * scale_cols() * 4;
    return b;
  }
  // Dequantized element, for reference kernels and tests (slow).
  float at(int64_t row, int64_t col) const;
  // A view of rows [row_begin, row_begin + rows); row_begin must be block_out-aligned for fp8.
  WeightMatrix rows(int64_t row_begin, int64_t num_rows) const;
};

// One expert or a dense MLP: down(silu(gate(x)) * up(x)). The moe_experts op takes an array of them.
struct MlpWeights {
  WeightMatrix gate_proj, up_proj;  // [inter, hidden]
  WeightMatrix down_proj;           // [hidden, inter]
};

}  // namespace moat
