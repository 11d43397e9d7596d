// config.json -> ModelConfig. Absent fields take the defaults of the HF configuration classes
// (DeepseekV3Config in deepseek-ai/DeepSeek-V3's configuration_deepseek.py, DeepseekV2Config in
// DeepSeek-V2's), so a config that loads in transformers loads here with the same values. The
// exception: the few fields that set the model's size (vocab_size, hidden_size,
// num_hidden_layers, num_attention_heads) are required, because silently defaulting them to
// the 671B shapes only turns a broken config into a confusing shape error at load time.
#include "config/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <fstream>
#include <sstream>
#include <tuple>

namespace moat {

namespace {

using nlohmann::json;

struct Family {
  std::string_view architecture;
  std::vector<std::string_view> model_types;  // first one is the canonical type
};

const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      {"DeepseekV3ForCausalLM", {"deepseek_v3", "kimi_k2"}},
      {"DeepseekV2ForCausalLM", {"deepseek_v2"}},
      {"KimiLinearForCausalLM", {"kimi_linear"}},
      // Kimi K3: a vision tower plus a Kimi Linear text model in text_config (only that is read)
      {"KimiK3ForConditionalGeneration", {"kimi_k3"}},
  };
  return kFamilies;
}

std::string supported_architectures() {
  std::string s;
  for (const auto& f : families()) s += (s.empty() ? "" : ", ") + std::string(f.architecture);
  return s;
}

// The HF class defaults for everything not read as required.
ModelConfig family_defaults(std::string_view architecture) {
  ModelConfig c;
  if (architecture == "DeepseekV3ForCausalLM") {
    c.intermediate_size = 18432;
    c.moe_intermediate_size = 2048;
    c.num_key_value_heads = 128;
    c.num_nextn_predict_layers = 1;
    c.q_lora_rank = 1536;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    c.n_routed_experts = 256;
    c.n_shared_experts = 1;
    c.num_experts_per_tok = 8;
    c.n_group = 8;
    c.topk_group = 4;
    c.first_k_dense_replace = 3;
    c.moe_layer_freq = 1;
    c.routed_scaling_factor = 2.5;
    c.norm_topk_prob = true;
    c.topk_method = "noaux_tc";
    c.scoring_func = "sigmoid";
    c.max_position_embeddings = 4096;
    c.bos_token_id = 0;
    c.eos_token_ids = {1};
  } else if (architecture == "KimiLinearForCausalLM" || architecture == "KimiK3ForConditionalGeneration") {
    // KimiLinearConfig's defaults (moonshotai/Kimi-Linear-48B-A3B-Instruct configuration_kimi.py):
    // no MoE, MLA sizes unset (the file always gives them), sigmoid noaux_tc routing when MoE.
    c.intermediate_size = 11008;
    c.moe_intermediate_size = 0;
    c.num_key_value_heads = 0;  // "as many as the attention heads", set after parsing
    c.num_nextn_predict_layers = 0;
    c.q_lora_rank.reset();
    c.n_routed_experts = 0;
    c.n_shared_experts = 0;
    c.num_experts_per_tok = 0;
    c.n_group = 1;
    c.topk_group = 1;
    c.first_k_dense_replace = 0;
    c.moe_layer_freq = 1;
    c.routed_scaling_factor = 1.0;
    c.norm_topk_prob = true;  // moe_renormalize
    c.topk_method = "noaux_tc";
    c.scoring_func = "sigmoid";  // moe_router_activation_func
    c.max_position_embeddings = 4096;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
  } else {  // DeepseekV2ForCausalLM
    c.intermediate_size = 11008;
    c.moe_intermediate_size = 1407;
    c.num_key_value_heads = 32;
    c.num_nextn_predict_layers = 0;
    c.q_lora_rank = 1536;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    // HF's V2 defaults are None for the MoE fields: a dense model.
    c.n_routed_experts = 0;
    c.n_shared_experts = 0;
    c.num_experts_per_tok = 0;
    c.n_group = 1;
    c.topk_group = 1;
    c.first_k_dense_replace = 0;
    c.moe_layer_freq = 1;
    c.routed_scaling_factor = 1.0;
    c.norm_topk_prob = false;
    c.topk_method = "greedy";  // HF spells its default "gready"; every published config says greedy
    c.scoring_func = "softmax";
    c.max_position_embeddings = 2048;
    c.bos_token_id = 100000;
    c.eos_token_ids = {100001};
  }
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.torch_dtype = DType::BF16;
  return c;
}

std::string type_name(const json& v) { return v.type_name(); }

// Field readers. Each returns an error naming the field when the value has the wrong type;
// an absent field (or JSON null, where HF treats None as "use the default") leaves *out as is.
Status read_int(const json& obj, const char* key, int64_t* out, const char* where = "") {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return ok_status();
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    return make_error("config field '{}{}': {} does not fit in a 64-bit integer", where, key, it->dump());
  if (it->is_number_integer() || it->is_number_unsigned()) {
    *out = it->get<int64_t>();
    return ok_status();
  }
  if (it->is_number_float()) {
    double d = it->get<double>();
    if (std::floor(d) == d && std::abs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return ok_status();
    }
  }
  return make_error("config field '{}{}': expected an integer, got {} {}", where, key,
                    type_name(*it), it->dump());
}

// An optional field of one JSON kind (absent or null leaves *out as it is).
template <typename T>
Status read_kind(const json& obj, const char* key, T* out, const char* where, bool (json::*is_kind)() const noexcept,
                 const char* expected) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return ok_status();
  if (!((*it).*is_kind)())
    return make_error("config field '{}{}': expected {}, got {} {}", where, key, expected, type_name(*it), it->dump());
  *out = it->get<T>();
  return ok_status();
}

Status read_double(const json& obj, const char* key, double* out, const char* where = "") {
  return read_kind(obj, key, out, where, &json::is_number, "a number");
}

Status read_bool(const json& obj, const char* key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return ok_status();
  if (!it->is_boolean())
    return make_error("config field '{}': expected true or false, got {}", key, it->dump());
  *out = it->get<bool>();
  return ok_status();
}

Status read_string(const json& obj, const char* key, std::string* out, const char* where = "") {
  return read_kind(obj, key, out, where, &json::is_string, "a string");
}

Status require(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null())
    return make_error("config field '{}' is missing: it is required", key);
  return ok_status();
}

Result<RopeScaling> parse_rope_scaling(const json& j) {
  if (!j.is_object())
    return make_error("config field 'rope_scaling': expected an object or null, got {}",
                      j.dump());
  RopeScaling r;
  // Older configs spell the kind "type", newer transformers versions "rope_type".
  std::string type;
  MOAT_TRY(read_string(j, "type", &type, "rope_scaling."));
  if (type.empty()) MOAT_TRY(read_string(j, "rope_type", &type, "rope_scaling."));
  if (type != "yarn")
    return make_error(
        "config field 'rope_scaling.type': expected \"yarn\" (the only scaling these models "
        "use), got \"{}\"",
        type);
  r.type = type;
  if (!j.contains("factor") || j["factor"].is_null())
    return make_error("config field 'rope_scaling.factor' is missing: yarn needs it");
  MOAT_TRY(read_double(j, "factor", &r.factor, "rope_scaling."));
  MOAT_TRY(read_int(j, "original_max_position_embeddings", &r.original_max_position_embeddings,
                    "rope_scaling."));
  MOAT_TRY(read_double(j, "beta_fast", &r.beta_fast, "rope_scaling."));
  MOAT_TRY(read_double(j, "beta_slow", &r.beta_slow, "rope_scaling."));
  MOAT_TRY(read_double(j, "mscale", &r.mscale, "rope_scaling."));
  MOAT_TRY(read_double(j, "mscale_all_dim", &r.mscale_all_dim, "rope_scaling."));
  if (!(r.factor >= 1.0))
    return make_error("config field 'rope_scaling.factor': expected a number >= 1, got {}",
                      r.factor);
  if (r.original_max_position_embeddings <= 0)
    return make_error(
        "config field 'rope_scaling.original_max_position_embeddings': expected > 0, got {}",
        r.original_max_position_embeddings);
  return r;
}

Result<QuantizationConfig> parse_quantization(const json& j) {
  if (!j.is_object())
    return make_error("config field 'quantization_config': expected an object, got {}",
                      j.dump());
  QuantizationConfig q;
  q.fmt = "e4m3";
  q.activation_scheme = "dynamic";
  MOAT_TRY(read_string(j, "quant_method", &q.quant_method, "quantization_config."));
  if (q.quant_method == "compressed-tensors") return parse_compressed_tensors_quantization(j);
  if (q.quant_method != "fp8")
    return make_error(
        "config field 'quantization_config.quant_method': expected \"fp8\" (block-scaled "
        "e4m3) or \"compressed-tensors\" (MXFP4 / INT4 groups of 32), got \"{}\"",
        q.quant_method);
  MOAT_TRY(read_string(j, "fmt", &q.fmt, "quantization_config."));
  if (q.fmt != "e4m3")
    return make_error("config field 'quantization_config.fmt': expected \"e4m3\", got \"{}\"",
                      q.fmt);
  MOAT_TRY(read_string(j, "activation_scheme", &q.activation_scheme, "quantization_config."));
  if (auto it = j.find("weight_block_size"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->size() != 2 || !(*it)[0].is_number_integer() ||
        !(*it)[1].is_number_integer() || (*it)[0].get<int64_t>() <= 0 ||
        (*it)[1].get<int64_t>() <= 0)
      return make_error(
          "config field 'quantization_config.weight_block_size': expected two positive "
          "integers [block_out, block_in], got {}",
          it->dump());
    q.block_out = (*it)[0].get<int64_t>();
    q.block_in = (*it)[1].get<int64_t>();
  }
  return q;
}

// An optional integer field whose explicit null means `if_null` (HF's None disables a feature:
// no MoE, one expert group).
Status read_nullable(const json& j, const char* key, int64_t* out, int64_t if_null) {
  if (auto it = j.find(key); it != j.end() && it->is_null()) {
    *out = if_null;
    return ok_status();
  }
  return read_int(j, key, out);
}

// Kimi Linear's spellings of the MoE fields, its MLA switch and linear_attn_config.
Status read_kimi_linear_fields(const json& j, ModelConfig& c) {
  MOAT_TRY(read_nullable(j, "num_experts", &c.n_routed_experts, 0));
  MOAT_TRY(read_nullable(j, "num_experts_per_token", &c.num_experts_per_tok, 0));
  MOAT_TRY(read_nullable(j, "num_shared_experts", &c.n_shared_experts, 0));
  MOAT_TRY(read_nullable(j, "moe_intermediate_size", &c.moe_intermediate_size, 0));
  MOAT_TRY(read_bool(j, "moe_renormalize", &c.norm_topk_prob));
  MOAT_TRY(read_string(j, "moe_router_activation_func", &c.scoring_func));
  bool grouped = true;
  MOAT_TRY(read_bool(j, "use_grouped_topk", &grouped));
  MOAT_TRY(read_nullable(j, "num_expert_group", &c.n_group, 1));
  MOAT_TRY(read_nullable(j, "topk_group", &c.topk_group, 1));
  if (!grouped) c.n_group = c.topk_group = 1;  // plain top-k over all experts
  // The router selects with e_score_correction_bias and weights by the unbiased sigmoid scores
  // (vLLM and sglang; ../shared/K3.md): DeepSeek-V3's noaux_tc. A softmax router has no bias.
  if (c.scoring_func == "softmax") c.topk_method = grouped && c.n_group > 1 ? "group_limited_greedy" : "greedy";
  MOAT_TRY(read_bool(j, "mla_use_nope", &c.mla_use_nope));
  MOAT_TRY(read_bool(j, "mla_use_output_gate", &c.mla_use_output_gate));
  MOAT_TRY(read_int(j, "attn_res_block_size", &c.attn_res_block_size));
  MOAT_TRY(read_int(j, "routed_expert_hidden_size", &c.routed_expert_hidden_size));
  MOAT_TRY(read_bool(j, "latent_moe_use_norm", &c.latent_moe_use_norm));
  MOAT_TRY(read_string(j, "hidden_act", &c.hidden_act));
  if (c.hidden_act != "silu" && c.hidden_act != "situ")
    return make_error("config field 'hidden_act': expected \"silu\" or \"situ\", got \"{}\"", c.hidden_act);
  MOAT_TRY(read_double(j, "activation_situ_beta", &c.situ_beta));
  MOAT_TRY(read_double(j, "activation_situ_linear_beta", &c.situ_linear_beta));

  auto it = j.find("linear_attn_config");
  if (it == j.end() || it->is_null()) return ok_status();  // every layer MLA
  if (!it->is_object())
    return make_error("config field 'linear_attn_config': expected an object, got {}", it->dump());
  LinearAttentionConfig la;
  for (const char* key : {"num_heads", "head_dim", "kda_layers", "full_attn_layers"})
    if (!it->contains(key) || (*it)[key].is_null())
      return make_error("config field 'linear_attn_config.{}' is missing: it is required", key);
  MOAT_TRY(read_int(*it, "num_heads", &la.num_heads, "linear_attn_config."));
  MOAT_TRY(read_int(*it, "head_dim", &la.head_dim, "linear_attn_config."));
  MOAT_TRY(read_int(*it, "short_conv_kernel_size", &la.short_conv_kernel_size, "linear_attn_config."));
  MOAT_TRY(read_double(*it, "gate_lower_bound", &la.gate_lower_bound, "linear_attn_config."));
  MOAT_TRY(read_bool(*it, "use_full_rank_gate", &la.use_full_rank_gate));
  for (auto [key, out] : {std::pair<const char*, std::vector<int64_t>*>{"kda_layers", &la.kda_layers},
                          {"full_attn_layers", &la.full_attn_layers}}) {
    const json& list = (*it)[key];
    if (!list.is_array())
      return make_error("config field 'linear_attn_config.{}': expected a list of 1-based layer ids, got {}", key,
                        list.dump());
    for (const json& e : list) {
      if (!e.is_number_integer())
        return make_error("config field 'linear_attn_config.{}': expected integers, got {}", key, list.dump());
      out->push_back(e.get<int64_t>());
    }
  }
  c.linear_attn = std::move(la);
  return ok_status();
}

Result<DType> parse_torch_dtype(const std::string& s) {
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16" || s == "half") return DType::F16;
  if (s == "float32" || s == "float") return DType::F32;
  return make_error(
      "config field 'torch_dtype': expected \"bfloat16\", \"float16\" or \"float32\", got \"{}\"",
      s);
}

// Upper bounds no real checkpoint comes near (DeepSeek-V3: vocab 129280, hidden 7168, 61
// layers, 128 heads, 256 experts, 163840 positions), so that an absurd value is refused here
// instead of becoming a multi-terabyte allocation or an int64 overflow in a product of sizes.
constexpr int64_t kMaxVocab = int64_t{1} << 24;      // token ids are int32, tables per id
constexpr int64_t kMaxWidth = int64_t{1} << 20;      // any hidden / intermediate / rank / head dim
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 16384;
constexpr int64_t kMaxExperts = 65536;
constexpr int64_t kMaxPositions = int64_t{1} << 24;  // RoPE tables are sized by it
constexpr double kMaxParameters = 1e14;              // 35x the largest model in data/models.json

// Parameters the config describes (embeddings, attention, dense or MoE MLP per layer), in double
// so that no product of sizes can overflow.
double parameter_count(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size);
  const double heads = static_cast<double>(c.num_attention_heads);
  const double qk = static_cast<double>(c.qk_head_dim());
  const double q = c.q_lora_rank ? h * *c.q_lora_rank + *c.q_lora_rank * heads * qk : h * heads * qk;
  const double kv = h * static_cast<double>(c.kv_cache_dim()) +
                    static_cast<double>(c.kv_lora_rank) * heads * static_cast<double>(c.qk_nope_head_dim + c.v_head_dim);
  const double attention = q + kv + heads * static_cast<double>(c.v_head_dim) * h;
  const double dense = 3 * h * static_cast<double>(c.intermediate_size);
  const double moe = 3 * h * static_cast<double>(c.moe_intermediate_size) *
                         static_cast<double>(c.n_routed_experts + c.n_shared_experts) +
                     h * static_cast<double>(c.n_routed_experts);
  const double layers = static_cast<double>(c.num_hidden_layers + c.num_nextn_predict_layers);
  double kda = 0;
  if (c.linear_attn) {  // q, k, v, o, gate and output-gate projections: ~6 x hidden x heads x head_dim per layer
    const double width = static_cast<double>(c.linear_attn->num_heads) * static_cast<double>(c.linear_attn->head_dim);
    kda = static_cast<double>(c.linear_attn->kda_layers.size()) * 6 * h * width;
  }
  return 2 * static_cast<double>(c.vocab_size) * h + layers * (attention + std::max(dense, moe)) + kda;
}

Status validate(const ModelConfig& c) {
  auto positive = [](const char* field, int64_t v) -> Status {
    if (v <= 0) return make_error("config field '{}': expected > 0, got {}", field, v);
    return ok_status();
  };
  auto at_most = [](const char* field, int64_t v, int64_t limit) -> Status {
    if (v > limit)
      return make_error("config field '{}': {} is beyond any real model (at most {})", field, v, limit);
    return ok_status();
  };
  auto finite = [](const char* field, double v) -> Status {
    if (!std::isfinite(v)) return make_error("config field '{}': expected a finite number, got {}", field, v);
    return ok_status();
  };
  auto non_negative = [](const char* field, int64_t v) -> Status {
    if (v < 0) return make_error("config field '{}': expected >= 0, got {}", field, v);
    return ok_status();
  };
  MOAT_TRY(positive("vocab_size", c.vocab_size));
  MOAT_TRY(positive("hidden_size", c.hidden_size));
  MOAT_TRY(positive("num_hidden_layers", c.num_hidden_layers));
  MOAT_TRY(positive("num_attention_heads", c.num_attention_heads));
  MOAT_TRY(positive("num_key_value_heads", c.num_key_value_heads));
  MOAT_TRY(non_negative("num_nextn_predict_layers", c.num_nextn_predict_layers));
  if (c.q_lora_rank) MOAT_TRY(positive("q_lora_rank", *c.q_lora_rank));
  MOAT_TRY(positive("kv_lora_rank", c.kv_lora_rank));
  MOAT_TRY(non_negative("qk_nope_head_dim", c.qk_nope_head_dim));
  MOAT_TRY(positive("qk_rope_head_dim", c.qk_rope_head_dim));
  if (c.qk_rope_head_dim % 2 != 0)
    return make_error("config field 'qk_rope_head_dim': expected an even number (RoPE rotates "
                      "pairs), got {}",
                      c.qk_rope_head_dim);
  MOAT_TRY(positive("v_head_dim", c.v_head_dim));
  MOAT_TRY(positive("max_position_embeddings", c.max_position_embeddings));
  MOAT_TRY(finite("rope_theta", c.rope_theta));
  MOAT_TRY(finite("rms_norm_eps", c.rms_norm_eps));
  MOAT_TRY(finite("routed_scaling_factor", c.routed_scaling_factor));
  // RoPE's frequencies are theta^(-2i/d), and YaRN divides by ln(theta): theta must exceed 1.
  if (!(c.rope_theta > 1))
    return make_error("config field 'rope_theta': expected > 1, got {}", c.rope_theta);
  if (!(c.rms_norm_eps > 0))
    return make_error("config field 'rms_norm_eps': expected > 0, got {}", c.rms_norm_eps);
  if (c.rope_scaling) {
    const RopeScaling& r = *c.rope_scaling;
    MOAT_TRY(finite("rope_scaling.factor", r.factor));
    MOAT_TRY(finite("rope_scaling.mscale", r.mscale));
    MOAT_TRY(finite("rope_scaling.mscale_all_dim", r.mscale_all_dim));
    // YaRN takes ln(beta): both must be positive
    if (!(r.beta_fast > 0) || !std::isfinite(r.beta_fast))
      return make_error("config field 'rope_scaling.beta_fast': expected a finite number > 0, got {}", r.beta_fast);
    if (!(r.beta_slow > 0) || !std::isfinite(r.beta_slow))
      return make_error("config field 'rope_scaling.beta_slow': expected a finite number > 0, got {}", r.beta_slow);
    MOAT_TRY(at_most("rope_scaling.original_max_position_embeddings", r.original_max_position_embeddings,
                     kMaxPositions));
  }

  MOAT_TRY(at_most("vocab_size", c.vocab_size, kMaxVocab));
  MOAT_TRY(at_most("num_hidden_layers", c.num_hidden_layers, kMaxLayers));
  MOAT_TRY(at_most("num_nextn_predict_layers", c.num_nextn_predict_layers, kMaxLayers));
  MOAT_TRY(at_most("num_attention_heads", c.num_attention_heads, kMaxHeads));
  MOAT_TRY(at_most("num_key_value_heads", c.num_key_value_heads, kMaxHeads));
  MOAT_TRY(at_most("max_position_embeddings", c.max_position_embeddings, kMaxPositions));
  for (const auto& [field, v] : {std::pair<const char*, int64_t>{"hidden_size", c.hidden_size},
                                 {"intermediate_size", c.intermediate_size},
                                 {"moe_intermediate_size", c.moe_intermediate_size},
                                 {"q_lora_rank", c.q_lora_rank.value_or(0)},
                                 {"kv_lora_rank", c.kv_lora_rank},
                                 {"qk_nope_head_dim", c.qk_nope_head_dim},
                                 {"qk_rope_head_dim", c.qk_rope_head_dim},
                                 {"v_head_dim", c.v_head_dim}})
    MOAT_TRY(at_most(field, v, kMaxWidth));
  MOAT_TRY(at_most("n_routed_experts", c.n_routed_experts, kMaxExperts));
  MOAT_TRY(at_most("n_shared_experts", c.n_shared_experts, kMaxExperts));
  if (c.quantization) {
    MOAT_TRY(at_most("quantization_config.weight_block_size[0]", c.quantization->block_out, kMaxWidth));
    MOAT_TRY(at_most("quantization_config.weight_block_size[1]", c.quantization->block_in, kMaxWidth));
  }

  if (c.topk_method != "noaux_tc" && c.topk_method != "greedy" &&
      c.topk_method != "group_limited_greedy")
    return make_error("config field 'topk_method': expected one of noaux_tc, greedy, "
                      "group_limited_greedy, got \"{}\"",
                      c.topk_method);
  if (c.scoring_func != "sigmoid" && c.scoring_func != "softmax")
    return make_error("config field 'scoring_func': expected sigmoid or softmax, got \"{}\"",
                      c.scoring_func);
  MOAT_TRY(non_negative("n_routed_experts", c.n_routed_experts));
  MOAT_TRY(non_negative("n_shared_experts", c.n_shared_experts));
  MOAT_TRY(non_negative("first_k_dense_replace", c.first_k_dense_replace));
  MOAT_TRY(positive("moe_layer_freq", c.moe_layer_freq));

  bool any_dense = false;
  for (int64_t i = 0; i < c.num_hidden_layers && !any_dense; ++i) any_dense = !c.is_moe_layer(i);
  if (any_dense) MOAT_TRY(positive("intermediate_size", c.intermediate_size));

  if (c.n_routed_experts > 0) {
    MOAT_TRY(positive("moe_intermediate_size", c.moe_intermediate_size));
    MOAT_TRY(positive("num_experts_per_tok", c.num_experts_per_tok));
    MOAT_TRY(positive("n_group", c.n_group));
    MOAT_TRY(positive("topk_group", c.topk_group));
    if (c.num_experts_per_tok > c.n_routed_experts)
      return make_error("config field 'num_experts_per_tok': expected <= n_routed_experts ({}), "
                        "got {}",
                        c.n_routed_experts, c.num_experts_per_tok);
    if (c.n_routed_experts % c.n_group != 0)
      return make_error("config field 'n_group': n_routed_experts ({}) must be divisible by "
                        "n_group, got n_group = {}",
                        c.n_routed_experts, c.n_group);
    if (c.topk_group > c.n_group)
      return make_error("config field 'topk_group': expected <= n_group ({}), got {}", c.n_group,
                        c.topk_group);
    if (c.topk_method == "noaux_tc" && c.scoring_func != "sigmoid")
      return make_error("config field 'scoring_func': topk_method noaux_tc expects \"sigmoid\", "
                        "got \"{}\"",
                        c.scoring_func);
    // Group-limited routing picks all experts from the topk_group best groups.
    if (c.topk_method != "greedy") {
      const int64_t reachable = c.topk_group * (c.n_routed_experts / c.n_group);
      if (c.num_experts_per_tok > reachable)
        return make_error("config field 'num_experts_per_tok': {} routing reaches only "
                          "topk_group * n_routed_experts / n_group = {} experts, got {}",
                          c.topk_method, reachable, c.num_experts_per_tok);
    }
  }
  MOAT_TRY(non_negative("attn_res_block_size", c.attn_res_block_size));
  MOAT_TRY(non_negative("routed_expert_hidden_size", c.routed_expert_hidden_size));
  MOAT_TRY(at_most("routed_expert_hidden_size", c.routed_expert_hidden_size, kMaxWidth));
  if (c.hidden_act == "situ") {
    MOAT_TRY(finite("activation_situ_beta", c.situ_beta));
    MOAT_TRY(finite("activation_situ_linear_beta", c.situ_linear_beta));
    if (!(c.situ_beta > 0) || !(c.situ_linear_beta > 0))
      return make_error("config fields 'activation_situ_beta' / 'activation_situ_linear_beta': expected > 0, got {} / {}",
                        c.situ_beta, c.situ_linear_beta);
  }
  if (c.linear_attn) {
    const LinearAttentionConfig& la = *c.linear_attn;
    if (!std::isfinite(la.gate_lower_bound) || la.gate_lower_bound > 0)
      return make_error("config field 'linear_attn_config.gate_lower_bound': expected a finite number <= 0, got {}",
                        la.gate_lower_bound);

    MOAT_TRY(positive("linear_attn_config.num_heads", la.num_heads));
    MOAT_TRY(positive("linear_attn_config.head_dim", la.head_dim));
    MOAT_TRY(positive("linear_attn_config.short_conv_kernel_size", la.short_conv_kernel_size));
    MOAT_TRY(at_most("linear_attn_config.num_heads", la.num_heads, kMaxHeads));
    MOAT_TRY(at_most("linear_attn_config.head_dim", la.head_dim, 4096));  // the state is head_dim^2 per head
    MOAT_TRY(at_most("linear_attn_config.short_conv_kernel_size", la.short_conv_kernel_size, 64));
    std::vector<int> kind(static_cast<size_t>(c.num_hidden_layers), 0);
    for (auto [key, list, mark] : {std::tuple<const char*, const std::vector<int64_t>*, int>{"kda_layers", &la.kda_layers, 1},
                                   {"full_attn_layers", &la.full_attn_layers, 2}}) {
      for (int64_t id : *list) {
        if (id < 1 || id > c.num_hidden_layers)
          return make_error("config field 'linear_attn_config.{}': layer id {} outside 1..num_hidden_layers ({}); the "
                            "ids are 1-based",
                            key, id, c.num_hidden_layers);
        int& k = kind[static_cast<size_t>(id - 1)];
        if (k == mark) return make_error("config field 'linear_attn_config.{}': layer {} is listed twice", key, id);
        if (k != 0)
          return make_error("config field 'linear_attn_config': layer {} is in both kda_layers and full_attn_layers", id);
        k = mark;
      }
    }
  }
  if (const double n = parameter_count(c); n > kMaxParameters)
    return make_error("config: the sizes describe {:.3g} parameters, over {:.0e}: a size field is wrong "
                      "(hidden_size {}, num_hidden_layers {}, vocab_size {}, n_routed_experts {}, "
                      "moe_intermediate_size {}, intermediate_size {})",
                      n, kMaxParameters, c.hidden_size, c.num_hidden_layers, c.vocab_size, c.n_routed_experts,
                      c.moe_intermediate_size, c.intermediate_size);
  return ok_status();
}

}  // namespace

double yarn_get_mscale(double factor, double mscale) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(factor) + 1.0;
}

bool ModelConfig::is_kda_layer(int64_t layer) const {
  if (!linear_attn) return false;
  const auto& ids = linear_attn->kda_layers;
  return std::find(ids.begin(), ids.end(), layer + 1) != ids.end();
}

int64_t ModelConfig::num_kda_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += is_kda_layer(i);
  return n;
}

int64_t ModelConfig::kda_state_floats_per_layer() const {
  if (!linear_attn) return 0;
  const int64_t width = linear_attn->num_heads * linear_attn->head_dim;
  return 3 * (linear_attn->short_conv_kernel_size - 1) * width + linear_attn->num_heads * linear_attn->head_dim * linear_attn->head_dim;
}

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_scaling && rope_scaling->mscale_all_dim != 0.0) {
    const double m = yarn_get_mscale(rope_scaling->factor, rope_scaling->mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

Result<ModelConfig> parse_model_config(const nlohmann::json& j) {
  if (!j.is_object())
    return make_error("config: expected a JSON object at the top level, got {}", j.type_name());

  // architectures: the first supported entry decides the family.
  auto arch_it = j.find("architectures");
  if (arch_it == j.end() || arch_it->is_null())
    return make_error("config field 'architectures' is missing: expected one of [{}]",
                      supported_architectures());
  if (!arch_it->is_array() || arch_it->empty())
    return make_error("config field 'architectures': expected a non-empty list, got {}",
                      arch_it->dump());
  const Family* family = nullptr;
  for (const auto& a : *arch_it) {
    if (!a.is_string()) continue;
    for (const auto& f : families())
      if (a.get<std::string>() == f.architecture) family = &f;
    if (family) break;
  }
  if (!family)
    return make_error("config field 'architectures': {} is not supported; supported: [{}]",
                      arch_it->dump(), supported_architectures());

  ModelConfig c = family_defaults(family->architecture);
  c.architecture = family->architecture;
  c.model_type = family->model_types.front();
  MOAT_TRY(read_string(j, "model_type", &c.model_type));
  bool type_ok = false;
  for (auto t : family->model_types) type_ok = type_ok || t == c.model_type;
  if (!type_ok) {
    std::string expected;
    for (auto t : family->model_types) expected += (expected.empty() ? "" : ", ") + std::string(t);
    return make_error("config field 'model_type': {} expects one of [{}], got \"{}\"",
                      c.architecture, expected, c.model_type);
  }

  if (c.architecture == "KimiK3ForConditionalGeneration") {
    // Only the text model runs (the vision tower and projector are not loaded): its config is
    // text_config, a Kimi Linear config with K3's fields, and its tensors sit under "language_model.".
    auto text = j.find("text_config");
    if (text == j.end() || !text->is_object())
      return make_error("config field 'text_config' is missing or not an object: KimiK3ForConditionalGeneration keeps "
                        "its text model's config there");
    json t = *text;
    if (!t.contains("architectures")) t["architectures"] = {"KimiLinearForCausalLM"};
    if (!t.contains("model_type")) t["model_type"] = "kimi_linear";
    auto inner = parse_model_config(t);
    if (!inner.ok()) return make_error("text_config: {}", inner.error().message);
    if (inner->architecture != "KimiLinearForCausalLM")
      return make_error("text_config: expected a KimiLinearForCausalLM (kimi_linear) text model, got {}",
                        inner->architecture);
    ModelConfig k3 = std::move(inner).value();
    k3.architecture = c.architecture;
    k3.model_type = c.model_type;
    k3.weight_prefix = "language_model.";
    if (k3.linear_attn && k3.linear_attn->num_heads > k3.linear_attn->head_dim)
      return make_error("text_config.linear_attn_config.num_heads: {} heads, but K3's A_log holds head_dim ({}) "
                        "entries, one per head",
                        k3.linear_attn->num_heads, k3.linear_attn->head_dim);
    return k3;
  }

  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"})
    MOAT_TRY(require(j, key));
  MOAT_TRY(read_int(j, "vocab_size", &c.vocab_size));
  MOAT_TRY(read_int(j, "hidden_size", &c.hidden_size));
  MOAT_TRY(read_int(j, "intermediate_size", &c.intermediate_size));
  MOAT_TRY(read_int(j, "moe_intermediate_size", &c.moe_intermediate_size));
  MOAT_TRY(read_int(j, "num_hidden_layers", &c.num_hidden_layers));
  MOAT_TRY(read_int(j, "num_nextn_predict_layers", &c.num_nextn_predict_layers));
  MOAT_TRY(read_int(j, "num_attention_heads", &c.num_attention_heads));
  // HF: an explicit null means "as many as the attention heads"; absent means the class default.
  if (auto it = j.find("num_key_value_heads"); it != j.end() && it->is_null())
    c.num_key_value_heads = c.num_attention_heads;
  MOAT_TRY(read_int(j, "num_key_value_heads", &c.num_key_value_heads));
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;  // Kimi Linear's default

  // q_lora_rank: null means no query compression (q = q_proj(x), as in V2-Lite).
  if (auto it = j.find("q_lora_rank"); it != j.end()) {
    if (it->is_null()) {
      c.q_lora_rank.reset();
    } else {
      int64_t r = 0;
      MOAT_TRY(read_int(j, "q_lora_rank", &r));
      c.q_lora_rank = r;
    }
  }
  MOAT_TRY(read_int(j, "kv_lora_rank", &c.kv_lora_rank));
  MOAT_TRY(read_int(j, "qk_nope_head_dim", &c.qk_nope_head_dim));
  MOAT_TRY(read_int(j, "qk_rope_head_dim", &c.qk_rope_head_dim));
  MOAT_TRY(read_int(j, "v_head_dim", &c.v_head_dim));

  // MoE. In V2 configs null means "no MoE" / "no groups", which the defaults already say; in a V3
  // config a null here is read the same way (None disables the feature in HF's modeling code).
  MOAT_TRY(read_nullable(j, "n_routed_experts", &c.n_routed_experts, 0));
  MOAT_TRY(read_nullable(j, "n_shared_experts", &c.n_shared_experts, 0));
  MOAT_TRY(read_nullable(j, "num_experts_per_tok", &c.num_experts_per_tok, 0));
  MOAT_TRY(read_nullable(j, "n_group", &c.n_group, 1));
  MOAT_TRY(read_nullable(j, "topk_group", &c.topk_group, 1));
  MOAT_TRY(read_int(j, "first_k_dense_replace", &c.first_k_dense_replace));
  MOAT_TRY(read_int(j, "moe_layer_freq", &c.moe_layer_freq));
  MOAT_TRY(read_double(j, "routed_scaling_factor", &c.routed_scaling_factor));
  MOAT_TRY(read_bool(j, "norm_topk_prob", &c.norm_topk_prob));
  MOAT_TRY(read_string(j, "topk_method", &c.topk_method));
  MOAT_TRY(read_string(j, "scoring_func", &c.scoring_func));

  if (c.architecture == "KimiLinearForCausalLM" || c.architecture == "KimiK3ForConditionalGeneration")
    MOAT_TRY(read_kimi_linear_fields(j, c));

  // Kimi Linear's config gives its context as model_max_length (no max_position_embeddings).
  if (c.architecture != "DeepseekV3ForCausalLM" && c.architecture != "DeepseekV2ForCausalLM" &&
      !j.contains("max_position_embeddings"))
    MOAT_TRY(read_int(j, "model_max_length", &c.max_position_embeddings));
  MOAT_TRY(read_int(j, "max_position_embeddings", &c.max_position_embeddings));
  MOAT_TRY(read_double(j, "rope_theta", &c.rope_theta));
  MOAT_TRY(read_double(j, "rms_norm_eps", &c.rms_norm_eps));
  MOAT_TRY(read_bool(j, "tie_word_embeddings", &c.tie_word_embeddings));

  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    MOAT_ASSIGN_OR_RETURN(RopeScaling r, parse_rope_scaling(*it));
    c.rope_scaling = std::move(r);
  }
  if (auto it = j.find("quantization_config"); it != j.end() && !it->is_null()) {
    MOAT_ASSIGN_OR_RETURN(QuantizationConfig q, parse_quantization(*it));
    c.quantization = std::move(q);
  }

  if (auto it = j.find("bos_token_id"); it != j.end()) {
    if (it->is_null()) {
      c.bos_token_id.reset();
    } else {
      int64_t id = 0;
      MOAT_TRY(read_int(j, "bos_token_id", &id));
      c.bos_token_id = id;
    }
  }
  if (auto it = j.find("eos_token_id"); it != j.end()) {
    c.eos_token_ids.clear();
    if (it->is_number_integer()) {
      c.eos_token_ids.push_back(it->get<int64_t>());
    } else if (it->is_array()) {
      for (const auto& e : *it) {
        if (!e.is_number_integer())
          return make_error("config field 'eos_token_id': expected an integer or a list of "
                            "integers, got {}",
                            it->dump());
        c.eos_token_ids.push_back(e.get<int64_t>());
      }
    } else if (!it->is_null()) {
      return make_error(
          "config field 'eos_token_id': expected an integer or a list of integers, got {}",
          it->dump());
    }
  }

  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  std::string dtype;
  MOAT_TRY(read_string(j, "dtype", &dtype));
  MOAT_TRY(read_string(j, "torch_dtype", &dtype));
  if (!dtype.empty()) {
    MOAT_ASSIGN_OR_RETURN(c.torch_dtype, parse_torch_dtype(dtype));
  }

  MOAT_TRY(validate(c));
  // Ids the file gives must name a token (the family defaults are left alone: V2's 100000 and
  // 100001 are meant for its own vocabulary).
  if (j.contains("bos_token_id") && c.bos_token_id && (*c.bos_token_id < 0 || *c.bos_token_id >= c.vocab_size))
    return make_error("config field 'bos_token_id': expected an id in [0, vocab_size {}), got {}", c.vocab_size,
                      *c.bos_token_id);
  for (int64_t id : c.eos_token_ids)
    if (j.contains("eos_token_id") && (id < 0 || id >= c.vocab_size))
      return make_error("config field 'eos_token_id': expected ids in [0, vocab_size {}), got {}", c.vocab_size,
                        j["eos_token_id"].dump());
  return c;
}

Result<ModelConfig> load_model_config(const std::filesystem::path& dir_or_file) {
  std::filesystem::path path = dir_or_file;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";
  std::ifstream in(path);
  if (!in) return make_error("{}: cannot open config file", path.string());
  std::stringstream text;
  text << in.rdbuf();
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e400
    return make_error("{}: invalid JSON: {}", path.string(), e.what());
  }
  auto config = parse_model_config(j);
  if (!config.ok()) return make_error("{}: {}", path.string(), config.error().message);
  return config;
}

}  // namespace moat
