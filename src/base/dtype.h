// Element types moat reads from checkpoints and computes with. Weights stay in their stored type
// (bf16, f16, fp8 e4m3 + block scales); activations are fp32.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace moat {

enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, F64, I64, I32, I16, I8, U8, BOOL };

// Bytes per element.
size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "BF16", "F8_E4M3", ...
std::string_view dtype_name(DType dtype);
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

}  // namespace moat
