// Typed, checked access to one checkpoint tensor: a matrix comes back as a zero-copy WeightMatrix
// (bf16/f16/f32, or fp8 e4m3 + its "<name>_scale_inv" block scales), a small vector as fp32.
// Which tensors a model needs, with which names and shapes, is not written here: each
// architecture's weight spec (models/weight_spec.h) lists them, and models/ walks it with these
// calls, so the loader stays free of any architecture.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/weight.h"
#include "config/model_config.h"
#include "loader/checkpoint.h"

namespace moat {

// How a tensor is stored, which decides the dtypes a checkpoint may use for it.
enum class TensorStorage {
  vector,           // small tensors read whole as fp32: norms, biases ([n]), KDA conv weights
                    // [C, 1, W] and A_log [1, 1, H, 1]; bf16/f16/f32
  matrix,           // [out, in] Linear weight: bf16/f16/f32, or fp8 + scale_inv in fp8 checkpoints
  matrix_no_quant,  // [out, in] never fp8, even in fp8 checkpoints: embed_tokens, lm_head, router
};

// Checks presence, shape and dtype (and for fp8 the scale_inv sibling) of one tensor; the error
// names the tensor, what was expected and the shard, e.g. "model.layers.3.self_attn.kv_b_proj.weight:
// expected shape [2048, 512], got [2048, 256] (in model-00002-of-00004.safetensors)".
Status check_tensor(const Checkpoint& ckpt, const std::string& name, std::span<const int64_t> shape,
                    TensorStorage storage, const ModelConfig& config);

// A [out, in] matrix: checks presence, shape, dtype and (for fp8, when allow_fp8) the scale_inv
// sibling's dtype F32 and shape [ceil(out/block_out), ceil(in/block_in)]. No copy: data points
// into the mapping.
Result<WeightMatrix> get_matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                                int64_t in, const ModelConfig& config, bool allow_fp8 = true);

// A [n] vector converted to fp32 (a copy: for norms and biases, never for big tensors).
Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          int64_t n);
// A small tensor of any shape, flattened row-major to fp32 (KDA conv weights, A_log).
Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          std::span<const int64_t> shape);

}  // namespace moat
