#include "loader/weight_map.h"

#include <cstring>
#include <filesystem>

namespace moat {

namespace {

using Kind = ExpectedTensor::Kind;

std::string file_of(const TensorInfo& t) {
  return std::filesystem::path(t.file).filename().string();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_float_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }

Result<const TensorInfo*> find_with_shape(const Checkpoint& ckpt, const std::string& name,
                                          const std::vector<int64_t>& shape) {
  const TensorInfo* t = ckpt.find(name);
  if (!t)
    return make_error("{}: missing from the checkpoint (expected shape {})", name,
                      shape_str(shape));
  if (t->shape != shape)
    return make_error("{}: expected shape {}, got {} (in {})", name, shape_str(shape),
                      shape_str(t->shape), file_of(*t));
  return t;
}

Result<WeightMatrix> matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                            int64_t in, const ModelConfig& config, bool allow_fp8) {
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* t, find_with_shape(ckpt, name, {out, in}));
  WeightMatrix w;
  w.dtype = t->dtype;
  w.data = t->data;
  w.out_features = out;
  w.in_features = in;
  if (is_float_dtype(t->dtype)) return w;
  if (t->dtype != DType::F8_E4M3 || !allow_fp8)
    return make_error("{}: expected dtype BF16, F16 or F32{}, got {} (in {})", name,
                      allow_fp8 ? " or F8_E4M3 (fp8 checkpoints)" : "", dtype_name(t->dtype),
                      file_of(*t));
  if (!config.quantization)
    return make_error("{}: dtype F8_E4M3, but config.json has no quantization_config (in {})",
                      name, file_of(*t));
  w.block_out = config.quantization->block_out;
  w.block_in = config.quantization->block_in;
  const std::string scale_name = name + "_scale_inv";
  const std::vector<int64_t> scale_shape = {ceil_div(out, w.block_out), ceil_div(in, w.block_in)};
  const TensorInfo* s = ckpt.find(scale_name);
  if (!s)
    return make_error("{}: missing from the checkpoint (the F8_E4M3 weight {} needs its block "
                      "scales, shape {})",
                      scale_name, name, shape_str(scale_shape));
  if (s->shape != scale_shape)
    return make_error("{}: expected shape {} (blocks of {}x{} over [{}, {}]), got {} (in {})",
                      scale_name, shape_str(scale_shape), w.block_out, w.block_in, out, in,
                      shape_str(s->shape), file_of(*s));
  if (s->dtype != DType::F32)
    return make_error("{}: expected dtype F32, got {} (in {})", scale_name, dtype_name(s->dtype),
                      file_of(*s));
  w.scale_inv = reinterpret_cast<const float*>(s->data);
  return w;
}

Status check_vector(const Checkpoint& ckpt, const std::string& name, int64_t n) {
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* t, find_with_shape(ckpt, name, {n}));
  if (!is_float_dtype(t->dtype))
    return make_error("{}: expected dtype BF16, F16 or F32, got {} (in {})", name,
                      dtype_name(t->dtype), file_of(*t));
  return ok_status();
}

}  // namespace

std::string layer_tensor_name(int64_t layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c) {
  std::vector<ExpectedTensor> out;
  const int64_t h = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, Kind::kMatrixNoQuant});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto add = [&](const std::string& suffix, std::vector<int64_t> shape, Kind kind) {
      out.push_back({layer_tensor_name(i, suffix), std::move(shape), kind});
    };
    add("input_layernorm.weight", {h}, Kind::kVector);
    add("post_attention_layernorm.weight", {h}, Kind::kVector);
    // MLA
    if (c.q_lora_rank) {
      add("self_attn.q_a_proj.weight", {*c.q_lora_rank, h}, Kind::kMatrix);
      add("self_attn.q_a_layernorm.weight", {*c.q_lora_rank}, Kind::kVector);
      add("self_attn.q_b_proj.weight", {heads * c.qk_head_dim(), *c.q_lora_rank}, Kind::kMatrix);
    } else {
      add("self_attn.q_proj.weight", {heads * c.qk_head_dim(), h}, Kind::kMatrix);
    }
    add("self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h},
        Kind::kMatrix);
    add("self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, Kind::kVector);
    add("self_attn.kv_b_proj.weight", {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
        Kind::kMatrix);
    add("self_attn.o_proj.weight", {h, heads * c.v_head_dim}, Kind::kMatrix);
    // MLP
    if (!c.is_moe_layer(i)) {
      add("mlp.gate_proj.weight", {c.intermediate_size, h}, Kind::kMatrix);
      add("mlp.up_proj.weight", {c.intermediate_size, h}, Kind::kMatrix);
      add("mlp.down_proj.weight", {h, c.intermediate_size}, Kind::kMatrix);
      continue;
    }
    const int64_t moe = c.moe_intermediate_size;
    add("mlp.gate.weight", {c.n_routed_experts, h}, Kind::kMatrixNoQuant);
    if (c.topk_method == "noaux_tc")
      add("mlp.gate.e_score_correction_bias", {c.n_routed_experts}, Kind::kVector);
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const std::string p = "mlp.experts." + std::to_string(e) + ".";
      add(p + "gate_proj.weight", {moe, h}, Kind::kMatrix);
      add(p + "up_proj.weight", {moe, h}, Kind::kMatrix);
      add(p + "down_proj.weight", {h, moe}, Kind::kMatrix);
    }
    if (c.n_shared_experts > 0) {
      const int64_t shared = c.n_shared_experts * moe;
      add("mlp.shared_experts.gate_proj.weight", {shared, h}, Kind::kMatrix);
      add("mlp.shared_experts.up_proj.weight", {shared, h}, Kind::kMatrix);
      add("mlp.shared_experts.down_proj.weight", {h, shared}, Kind::kMatrix);
    }
  }
  out.push_back({"model.norm.weight", {h}, Kind::kVector});
  if (!c.tie_word_embeddings)
    out.push_back({"lm_head.weight", {c.vocab_size, h}, Kind::kMatrixNoQuant});
  return out;
}

Result<WeightMatrix> get_matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                                int64_t in, const ModelConfig& config) {
  return matrix(ckpt, name, out, in, config, /*allow_fp8=*/true);
}

Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          int64_t n) {
  MOAT_TRY(check_vector(ckpt, name, n));
  const TensorInfo* t = ckpt.find(name);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (t->dtype) {
      case DType::F32: std::memcpy(&v[i], t->data + 4 * i, 4); break;
      case DType::BF16:
      case DType::F16: {
        uint16_t bits;
        std::memcpy(&bits, t->data + 2 * i, 2);
        v[i] = t->dtype == DType::BF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
        break;
      }
      default: break;  // excluded by check_vector
    }
  }
  return v;
}

Status validate_checkpoint(const Checkpoint& ckpt, const ModelConfig& config) {
  for (const ExpectedTensor& e : expected_tensors(config)) {
    switch (e.kind) {
      case Kind::kVector: MOAT_TRY(check_vector(ckpt, e.name, e.shape[0])); break;
      case Kind::kMatrix:
      case Kind::kMatrixNoQuant: {
        auto w = matrix(ckpt, e.name, e.shape[0], e.shape[1], config,
                        /*allow_fp8=*/e.kind == Kind::kMatrix);
        if (!w.ok()) return w.take_error();
        break;
      }
    }
  }
  return ok_status();
}

}  // namespace moat
