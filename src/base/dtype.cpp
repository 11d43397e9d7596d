#include "base/dtype.h"

#include <array>
#include <cmath>
#include <limits>

namespace moat {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::F8_E4M3: case DType::I8: case DType::U8: case DType::BOOL: return 1;
    case DType::MXFP4: case DType::INT4_G32: return 0;
  }
  return 0;
}

int dtype_bits(DType dtype) {
  if (dtype == DType::MXFP4 || dtype == DType::INT4_G32) return 4;
  return 8 * static_cast<int>(dtype_size(dtype));
}

namespace {
struct NamedDType {
  DType dtype;
  std::string_view name;
  bool safetensors;  // a safetensors element type (not one of moat's packed weight formats)
};
constexpr NamedDType kNames[] = {
    {DType::F32, "F32", true},         {DType::F16, "F16", true},   {DType::BF16, "BF16", true},
    {DType::F8_E4M3, "F8_E4M3", true}, {DType::F64, "F64", true},   {DType::I64, "I64", true},
    {DType::I32, "I32", true},         {DType::I16, "I16", true},   {DType::I8, "I8", true},
    {DType::U8, "U8", true},           {DType::BOOL, "BOOL", true}, {DType::MXFP4, "MXFP4", false},
    {DType::INT4_G32, "INT4_G32", false},
};
}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& n : kNames)
    if (n.dtype == dtype) return n.name;
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& n : kNames)
    if (n.safetensors && n.name == name) return n.dtype;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  int exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    magnitude = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mant | 0x400u), exp - 25);
  }
  float f = magnitude;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u |= sign;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t f32_to_f16(float value) {
  // Via _Float16, which g++ 12 on x86-64 rounds to nearest even.
  _Float16 h = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

float fp8_e4m3_to_f32(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exp = (bits >> 3) & 0xf;
  const int mant = bits & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // mant/8 * 2^-6
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);     // (1+mant/8) * 2^(exp-7)
}

uint8_t f32_to_fp8_e4m3(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  float a = std::fabs(value);
  if (a >= 448.0f) return sign | 0x7e;  // saturate to the largest finite value
  // Exhaustive nearest search over the 127 non-negative finite codes: tiny and obviously right;
  // it runs only when checkpoints are quantized, never in inference.
  const float* table = fp8_e4m3_table();
  uint8_t best = 0;
  float best_err = std::numeric_limits<float>::infinity();
  for (int code = 0; code <= 0x7e; ++code) {
    float err = std::fabs(table[code] - a);
    if (err < best_err || (err == best_err && (code & 1) == 0)) {
      best_err = err;
      best = static_cast<uint8_t>(code);
    }
  }
  return sign | best;
}

const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_to_f32(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

const float* int4_code_table(DType dtype) {
  static constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  static constexpr float kInt4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  return dtype == DType::MXFP4 ? kE2M1 : kInt4;
}

}  // namespace moat
