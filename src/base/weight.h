// A weight matrix exactly as the checkpoint stores it: [out_features, in_features] row-major, in
// bf16/f16/f32; fp8 e4m3 with one fp32 scale per block_out x block_in tile
// (scale_inv: [ceil(out/block_out), ceil(in/block_in)]; W = Wq * scale_inv[i/bo][j/bi]); or a
// packed 4-bit format (MXFP4, INT4_G32: base/dtype.h) with one scale per 32 consecutive elements
// of a row (data: [out, in/2] bytes, element 2j in the low nibble of byte j; group_scales:
// [out, in/32]; W[i][j] = code_value(nibble) * scale[i][j/32]).
// data and the scales point into the checkpoint (mapped, or read into memory with --no-mmap) or into
// the few copies made at load: tensor-parallel column slices and realigned matrices (below).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "base/dtype.h"
#include "base/huge_pages.h"
#include "base/status.h"

namespace moat {

// How a 4-bit format's per-group scales are stored.
enum class GroupScaleKind : uint8_t {
  none,  // not a 4-bit format
  e8m0,  // one byte s, scale 2^(s - 127) (MXFP4)
  bf16,  // bfloat16 (INT4_G32)
};

struct WeightMatrix {
  DType dtype = DType::BF16;
  const void* data = nullptr;
  int64_t out_features = 0;
  int64_t in_features = 0;
  const float* scale_inv = nullptr;  // only for F8_E4M3
  int64_t block_out = 128;
  int64_t block_in = 128;
  // Only for MXFP4 / INT4_G32: [out_features, in_features / kGroupSize] scales of kind
  // group_scale_kind (e8m0 for MXFP4, bf16 for INT4_G32; packed_4bit sets both).
  const void* group_scales = nullptr;
  GroupScaleKind group_scale_kind = GroupScaleKind::none;

  // Elements per scale of the 4-bit formats (both published ones use 32; kernels rely on it).
  static constexpr int64_t kGroupSize = 32;

  // A view of a packed 4-bit matrix (dtype MXFP4 or INT4_G32; in % 32 == 0).
  static WeightMatrix packed_4bit(DType dtype, const void* packed, const void* scales, int64_t out, int64_t in);

  bool is_4bit() const { return dtype == DType::MXFP4 || dtype == DType::INT4_G32; }
  int64_t scale_cols() const { return (in_features + block_in - 1) / block_in; }
  // 4-bit formats: bytes per packed row (in / 2), scale groups per row (in / 32), bytes per scale.
  int64_t packed_row_bytes() const { return in_features / 2; }
  int64_t groups_per_row() const { return in_features / kGroupSize; }
  int64_t group_scale_bytes() const { return group_scale_kind == GroupScaleKind::bf16 ? 2 : 1; }
  // The scale of group `group` of row `row` (4-bit formats).
  float group_scale(int64_t row, int64_t group) const;
  // Bytes at `data` (the elements or packed codes), at `group_scales` (4-bit formats; 0 otherwise)
  // and at `scale_inv` (fp8; 0 otherwise).
  int64_t data_bytes() const {
    return is_4bit() ? out_features * packed_row_bytes() : out_features * in_features * static_cast<int64_t>(dtype_size(dtype));
  }
  int64_t group_scales_bytes() const { return is_4bit() ? out_features * groups_per_row() * group_scale_bytes() : 0; }
  int64_t scale_inv_bytes() const {
    return scale_inv ? ((out_features + block_out - 1) / block_out) * scale_cols() * 4 : 0;
  }
  // Bytes a matrix-vector product streams from memory (weights and scales).
  int64_t bytes() const { return data_bytes() + group_scales_bytes() + scale_inv_bytes(); }
  // Dequantized element, for reference kernels and tests (slow). An MXFP4 scale of 2^127 times a
  // code of magnitude >= 2 is past fp32's range and reads as +-inf, as in any fp32 decode.
  float at(int64_t row, int64_t col) const;
  // A view of rows [row_begin, row_begin + rows); row_begin must be block_out-aligned for fp8.
  WeightMatrix rows(int64_t row_begin, int64_t num_rows) const;
};

// Tensor parallelism's slices of a checkpoint matrix. A slice of rows (output features) is a view
// into the mapped file; a slice of columns is not contiguous, so it is copied once at load into
// storage the caller keeps (a row-parallel o_proj / down_proj: 1/tp of those bytes per rank). Both
// refuse a cut through a quantization block (fp8's 128 x 128 scale tiles, the 4-bit formats' 32
// columns per scale), naming the sizes, as vLLM does.
struct OwnedWeightBytes {
  HugePageVector<uint8_t> data;  // cache-line aligned (kWeightAlignment)
  std::vector<float> scale_inv;       // fp8
  std::vector<uint8_t> group_scales;  // 4-bit formats
};
Result<WeightMatrix> slice_rows(const WeightMatrix& w, int64_t row_begin, int64_t num_rows);
Result<WeightMatrix> copy_columns(const WeightMatrix& w, int64_t col_begin, int64_t num_cols, OwnedWeightBytes& storage);

// Kernels stream weight rows with 64-byte vector loads (AVX-512; two 32-byte ones on AVX2). A
// safetensors header pads the data only to 8 bytes, so a checkpoint's tensors start anywhere on a
// cache line, and from such a row every load touches two lines: one Zen 5 core then streams bf16
// decode weights ~8% slower (34-36 against 37-39 GB/s, the same matrices 16 bytes apart).
inline constexpr size_t kWeightAlignment = 64;
inline bool weight_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kWeightAlignment == 0; }

// Moves the matrices whose rows start off a kWeightAlignment boundary (their data; 4-bit formats'
// group scales where those are off a line) into `arena`, one allocation for all of them (2 MiB
// pages, no rounding up per matrix), and points them there; a moved matrix's scales (4-bit group
// scales, fp8 scale_inv) move with it, so nothing reads the source's pages again. Matrices sharing
// a data pointer share the copy. release(old pointer, bytes) is called for each source once it is
// copied (a mapped checkpoint drops its pages). Returns the bytes copied; 0 leaves `arena` untouched.
int64_t realign_weights(const std::vector<WeightMatrix*>& matrices, HugePageBuffer& arena,
                        const std::function<void(const void*, size_t)>& release);

// One expert or a dense MLP: down(silu(gate(x)) * up(x)). The moe_experts op takes an array of them.
struct MlpWeights {
  WeightMatrix gate_proj, up_proj;  // [inter, hidden]
  WeightMatrix down_proj;           // [hidden, inter]
};

}  // namespace moat
