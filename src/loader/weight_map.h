// What a DeepSeek-V2/V3 (and Kimi K2) checkpoint must hold for a given config, in the exact HF
// tensor names, and typed lookups for the model: a matrix comes back as a zero-copy
// WeightMatrix (bf16/f16/f32, or fp8 e4m3 + its "<name>_scale_inv" block scales), a small
// vector as fp32. Tensors of layers >= num_hidden_layers (the MTP layers) are never asked for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/weight.h"
#include "config/model_config.h"
#include "loader/checkpoint.h"

namespace moat {

struct ExpectedTensor {
  enum class Kind {
    kVector,          // norms, e_score_correction_bias: bf16/f16/f32
    kMatrix,          // Linear weight: bf16/f16/f32, or fp8 + scale_inv in fp8 checkpoints
    kMatrixNoQuant,   // embed_tokens, lm_head, mlp.gate: never fp8
  };
  std::string name;
  std::vector<int64_t> shape;  // [n] or [out, in]
  Kind kind = Kind::kMatrix;
};

// Every tensor the model reads, in layer order.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& config);

// "model.layers.{layer}.{suffix}".
std::string layer_tensor_name(int64_t layer, const std::string& suffix);

// A [out, in] matrix: checks presence, shape, dtype and (for fp8) the scale_inv sibling's dtype
// F32 and shape [ceil(out/block_out), ceil(in/block_in)]. No copy: data points into the mapping.
Result<WeightMatrix> get_matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                                int64_t in, const ModelConfig& config);

// A [n] vector converted to fp32 (a copy: for norms and biases, never for big tensors).
Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          int64_t n);

// Checks every expected tensor; returns the first problem, e.g.
// "model.layers.3.self_attn.kv_b_proj.weight: expected shape [2048, 512], got [2048, 256] (in
// model-00002-of-00004.safetensors)".
Status validate_checkpoint(const Checkpoint& ckpt, const ModelConfig& config);

}  // namespace moat
