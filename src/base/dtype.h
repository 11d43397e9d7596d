// Element types moat reads from checkpoints and computes with. Weights stay in their stored type
// (bf16, f16, fp8 e4m3 + block scales, 4-bit with a scale per 32 elements); activations are fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace moat {

// MXFP4 and INT4_G32 are weight formats, not safetensors element types: two 4-bit codes per byte
// (element 2j in the low nibble, 2j + 1 in the high one) plus one scale per 32 consecutive
// elements of a row, held apart (WeightMatrix::group_scales).
//   MXFP4     OCP e2m1 codes (bit 3 sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), e8m0 scale
//             byte s: value = e2m1 * 2^(s - 127) (compressed-tensors mxfp4-pack-quantized, gpt-oss).
//   INT4_G32  symmetric int4 stored as q + 8, bf16 scale: value = (nibble - 8) * scale
//             (compressed-tensors pack-quantized, Kimi K2-Thinking's routed experts).
enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, F64, I64, I32, I16, I8, U8, BOOL, MXFP4, INT4_G32 };

// Bytes per element; 0 for the packed 4-bit formats (two elements per byte: see dtype_bits).
size_t dtype_size(DType dtype);
// Bits per element (4 for MXFP4 and INT4_G32, scales not counted).
int dtype_bits(DType dtype);
// Safetensors spelling: "F32", "BF16", "F8_E4M3", ...; "MXFP4" / "INT4_G32" for the weight formats.
std::string_view dtype_name(DType dtype);
// Safetensors spellings only: a file cannot declare MXFP4 or INT4_G32.
std::optional<DType> dtype_from_name(std::string_view name);

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as PyTorch's .to(torch.bfloat16) does.
inline uint16_t f32_to_bf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN.
float fp8_e4m3_to_f32(uint8_t bits);
// Round to nearest even with saturation to +-448 (what torch's .to(float8_e4m3fn) does for
// finite values inside the range).
uint8_t f32_to_fp8_e4m3(float value);

// A 256-entry table, so hot loops decode fp8 with one load.
const float* fp8_e4m3_table();

// The 16 values of a 4-bit code before its group scale: e2m1 for MXFP4 (0, .5, 1, 1.5, 2, 3, 4,
// 6, then the same negated; code 8 is -0), nibble - 8 for INT4_G32.
const float* int4_code_table(DType dtype);

// e8m0 scale byte -> 2^(s - 127): s = 0 is 2^-127 (an fp32 subnormal), 254 is 2^127, 255 is NaN
// (the loader refuses checkpoints holding it).
inline float e8m0_to_f32(uint8_t s) {
  if (s == 0xff) return __builtin_nanf("");
  const uint32_t u = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace moat
