// config.json's quantization_config -> which weight format a checkpoint's quantized matrices use.
//   fp8 (DeepSeek-V3, Kimi K2): e4m3 weights + fp32 scale_inv per 128x128 block (model_config.cpp
//     parses it);
//   compressed-tensors (Kimi K3: "mxfp4-pack-quantized"; Kimi K2-Thinking: "pack-quantized" int4):
//     4-bit weights with one scale per 32 elements, parsed here. Which tensors are quantized is
//     decided per tensor by the presence of `X.weight_packed` (loader/weight_map.cpp), not by the
//     `ignore` list: read literally, K3's list would quantize more than its checkpoint does
//     (../shared/K3.md).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"

namespace moat {

struct QuantizationConfig {
  std::string quant_method;  // "fp8" or "compressed-tensors"
  std::string fmt;           // fp8: "e4m3"; compressed-tensors: "mxfp4-pack-quantized" or "pack-quantized"
  std::string activation_scheme;
  int64_t block_out = 128;   // fp8: weight_block_size[0]
  int64_t block_in = 128;    // fp8: weight_block_size[1]
  // The matmul weight dtype of the quantized matrices: F8_E4M3, MXFP4 or INT4_G32.
  DType weight_dtype = DType::F8_E4M3;
  // compressed-tensors: the modules the config says it left unquantized (kept for reports; the
  // loader goes by the tensors present).
  std::vector<std::string> ignore;
};

// Parses a quantization_config whose quant_method is "compressed-tensors". Accepted: weight-only
// 4-bit group quantization with group_size 32, symmetric, static: type "float" in format
// "mxfp4-pack-quantized" (MXFP4) or type "int" in format "pack-quantized" (INT4_G32). The format
// may sit at the top level or in a config group (Kimi K3 puts it in the group). Errors name the
// field: other bit widths or group sizes, asymmetric or dynamic weights, activation quantization,
// groups that disagree.
Result<QuantizationConfig> parse_compressed_tensors_quantization(const nlohmann::json& j);

}  // namespace moat
