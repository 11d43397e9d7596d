#include "plan/model_size.h"

#include <algorithm>
#include <cmath>

#include "models/registry.h"

namespace moat::plan {

using nlohmann::json;

Result<Precision> parse_precision(std::string_view name) {
  for (int i = 0; i < kNumPrecisions; ++i)
    if (kPrecisionNames[i] == name) return static_cast<Precision>(i);
  return make_error("--precision: unknown precision '{}'; expected one of bf16, fp8, mxfp4, int4",
                    name);
}

namespace {
double ceil_div(int64_t a, int64_t b) { return static_cast<double>((a + b - 1) / b); }
}  // namespace

double matrix_bytes(int64_t rows, int64_t cols, Precision p) {
  const double n = static_cast<double>(rows) * static_cast<double>(cols);
  switch (p) {
    case Precision::bf16: return 2 * n;
    case Precision::fp8: return n + 4 * ceil_div(rows, 128) * ceil_div(cols, 128);
    case Precision::mxfp4: return 0.5 * n + rows * ceil_div(cols, 32);
    case Precision::int4: return 0.5 * n + 2 * rows * ceil_div(cols, 128);
  }
  return 2 * n;
}

double bytes_per_param(Precision p) {
  switch (p) {
    case Precision::bf16: return 2;
    case Precision::fp8: return 1 + 4.0 / (128 * 128);
    case Precision::mxfp4: return 0.5 + 1.0 / 32;
    case Precision::int4: return 0.5 + 2.0 / 128;
  }
  return 2;
}

Result<int64_t> kv_dtype_bytes(std::string_view name) {
  if (name == "bf16" || name == "f16" || name == "fp16") return int64_t{2};
  if (name == "fp8" || name == "fp8_e4m3") return int64_t{1};
  if (name == "fp32" || name == "f32") return int64_t{4};
  return make_error("--kv-dtype: unknown KV cache dtype '{}'; expected one of bf16, fp8, fp32", name);
}

double ModelSize::kv_bytes_per_token_per_gpu(int64_t tp, int64_t kv_dtype_size) const {
  if (mla) return static_cast<double>(kv_layers * (kv_lora_rank + qk_rope_head_dim) * kv_dtype_size);
  const int64_t heads_here = std::max<int64_t>(1, (num_key_value_heads + tp - 1) / tp);
  return static_cast<double>(kv_layers * 2 * heads_here * head_dim * kv_dtype_size);
}

ModelConfig ModelSize::attention_config() const {
  if (config) return *config;
  ModelConfig c;
  c.num_attention_heads = num_attention_heads;
  c.num_key_value_heads = mla ? num_attention_heads : num_key_value_heads;
  c.kv_lora_rank = kv_lora_rank;
  c.qk_rope_head_dim = qk_rope_head_dim;
  c.n_routed_experts = n_routed_experts;
  c.num_experts_per_tok = experts_per_token;
  return c;
}

namespace {

// Running totals while walking the weight spec.
struct Tally {
  double params = 0, active_params = 0;
  PerPrecision bytes{}, active_bytes{}, routed_bytes{}, replicated_bytes{}, active_replicated_bytes{};

  void add(const TensorSpec& w, bool active) {
    const bool replicated = w.split == TpSplit::replicated || w.part == Part::embedding;
    const double n = static_cast<double>(w.numel());
    params += n;
    // The embedding table counts as active parameters (every token has one of its rows) but
    // decode reads one row of it, not its bytes.
    if (active || w.part == Part::embedding) active_params += n;
    const bool streamed = active && w.part != Part::embedding;
    const bool routed = w.part == Part::routed_expert;
    for (int i = 0; i < kNumPrecisions; ++i) {
      // Only Linear weights take the storage precision; embeddings, lm_head, norms and routers
      // stay bf16, as in the published FP8 and INT4 checkpoints. The 4-bit formats quantize the
      // routed experts only (Kimi K2-Thinking's INT4, Kimi K3's MXFP4): attention, shared
      // experts, dense MLPs and K3's latent projections stay bf16.
      const Precision p = static_cast<Precision>(i);
      const bool four_bit = p == Precision::mxfp4 || p == Precision::int4;
      const bool takes_precision = w.storage == TensorStorage::matrix && (!four_bit || routed);
      const double b = takes_precision ? matrix_bytes(w.shape[0], w.shape[1], p) : 2 * n;
      bytes[i] += b;
      if (streamed) active_bytes[i] += b;
      if (routed) routed_bytes[i] += b;
      if (replicated) replicated_bytes[i] += b;
      if (replicated && streamed) active_replicated_bytes[i] += b;
    }
  }
};

}  // namespace

Result<ModelSize> size_from_config(const ModelConfig& c, std::string id, std::string name) {
  MOAT_ASSIGN_OR_RETURN(WeightSpec spec, weight_spec_for(c));
  return size_from_spec(spec, std::move(id), std::move(name));
}

ModelSize size_from_spec(const WeightSpec& spec, std::string id, std::string name) {
  const ModelConfig& c = spec.config;
  Tally t;
  for (const TensorSpec& w : spec.tensors) t.add(w, spec.read_per_token(w));
  ModelSize m;
  m.id = std::move(id);
  m.name = std::move(name);
  m.total_params = t.params;
  m.active_params = t.active_params;
  m.weight_bytes = t.bytes;
  m.active_weight_bytes = t.active_bytes;
  m.routed_expert_bytes = t.routed_bytes;
  m.replicated_bytes = t.replicated_bytes;
  m.active_replicated_bytes = t.active_replicated_bytes;
  m.n_routed_experts = c.n_routed_experts;
  m.experts_per_token = c.num_experts_per_tok;
  m.num_attention_heads = c.num_attention_heads;
  m.mla = true;
  for (const LayerSpec& layer : spec.layers) m.kv_layers += layer.attention == AttentionKind::mla;
  m.kv_lora_rank = c.kv_lora_rank;
  m.qk_rope_head_dim = c.qk_rope_head_dim;
  // KDA layers (Kimi Linear): conv inputs + fp32 state per request, split by head under TP.
  m.state_bytes_per_request = static_cast<double>(c.state_bytes_per_request());
  m.state_split_by_tp = true;
  m.max_context = c.max_position_embeddings;
  // compressed-tensors 4-bit checkpoints size as mxfp4 / int4 (the planner's int4 assumes fp16
  // scales per 128; INT4_G32 carries bf16 per 32, 0.0625 instead of 0.0156 byte per value)
  m.default_precision = !c.quantization                                      ? Precision::bf16
                        : c.quantization->weight_dtype == DType::MXFP4    ? Precision::mxfp4
                        : c.quantization->weight_dtype == DType::INT4_G32 ? Precision::int4
                                                                          : Precision::fp8;
  m.config = c;
  return m;
}

namespace {

// Reads entry[key] as a number; the error names the entry and the field.
Result<double> number(const json& e, const std::string& where, const char* key, bool positive = true) {
  auto it = e.find(key);
  if (it == e.end()) return make_error("{}: field '{}' is missing", where, key);
  if (!it->is_number()) return make_error("{}: field '{}': expected a number, got {}", where, key, it->dump());
  const double v = it->get<double>();
  if (positive ? !(v > 0) : !(v >= 0))
    return make_error("{}: field '{}': expected {} 0, got {}", where, key, positive ? ">" : ">=", v);
  return v;
}

Result<int64_t> integer(const json& e, const std::string& where, const char* key, bool positive = true) {
  MOAT_ASSIGN_OR_RETURN(double v, number(e, where, key, positive));
  if (v != std::floor(v)) return make_error("{}: field '{}': expected an integer, got {}", where, key, v);
  return static_cast<int64_t>(v);
}

}  // namespace

Result<ModelSize> size_from_catalog_entry(const json& e) {
  if (!e.is_object()) return make_error("models catalog: expected an object per model, got {}", e.dump());
  if (!e.contains("id") || !e["id"].is_string())
    return make_error("models catalog: an entry has no string 'id': {}", e.dump().substr(0, 80));
  const std::string id = e["id"].get<std::string>();
  const std::string where = fmt::format("models catalog entry '{}'", id);
  const std::string name = e.value("name", id);
  ModelSize m;
  if (e.contains("config")) {
    auto config = parse_model_config(e["config"]);
    if (!config) return make_error("{}: config: {}", where, config.error().message);
    auto sized = size_from_config(*config, id, name);
    if (!sized) return make_error("{}: config: {}", where, sized.error().message);
    m = std::move(*sized);
  } else {
    m.id = id;
    m.name = name;
    MOAT_ASSIGN_OR_RETURN(m.total_params, number(e, where, "total_params"));
    MOAT_ASSIGN_OR_RETURN(m.active_params, number(e, where, "active_params"));
    MOAT_ASSIGN_OR_RETURN(double bf16_params, number(e, where, "bf16_params", false));
    MOAT_ASSIGN_OR_RETURN(m.num_attention_heads, integer(e, where, "num_attention_heads"));
    MOAT_ASSIGN_OR_RETURN(m.kv_layers, integer(e, where, "kv_layers"));
    if (e.contains("n_routed_experts")) {
      MOAT_ASSIGN_OR_RETURN(m.n_routed_experts, integer(e, where, "n_routed_experts", false));
    }
    if (m.n_routed_experts > 0) {
      MOAT_ASSIGN_OR_RETURN(m.experts_per_token, integer(e, where, "num_experts_per_tok"));
    }
    if (m.active_params > m.total_params)
      return make_error("{}: active_params ({}) exceeds total_params ({})", where, m.active_params, m.total_params);
    if (bf16_params > m.active_params)
      return make_error("{}: bf16_params ({}) exceeds active_params ({})", where, bf16_params, m.active_params);
    // Routed experts R from the totals: total = N + R and active = N + R k/E, where N (attention,
    // shared experts, embeddings) is used by every token.
    double routed = 0;
    if (m.n_routed_experts > 0) {
      const double frac = static_cast<double>(m.experts_per_token) / m.n_routed_experts;
      routed = frac < 1 ? (m.total_params - m.active_params) / (1 - frac) : 0;
    }
    const double quantized_rest = m.total_params - routed - bf16_params;
    for (int i = 0; i < kNumPrecisions; ++i) {
      const double r = bytes_per_param(static_cast<Precision>(i));
      m.routed_expert_bytes[i] = routed * r;
      m.weight_bytes[i] = (routed + quantized_rest) * r + 2 * bf16_params;
      const double frac = m.n_routed_experts > 0 ? static_cast<double>(m.experts_per_token) / m.n_routed_experts : 0;
      m.active_weight_bytes[i] = (routed * frac + quantized_rest) * r + 2 * bf16_params;
    }
    const std::string attention = e.value("attention", "mla");
    if (attention == "mla") {
      m.mla = true;
      MOAT_ASSIGN_OR_RETURN(m.kv_lora_rank, integer(e, where, "kv_lora_rank"));
      MOAT_ASSIGN_OR_RETURN(m.qk_rope_head_dim, integer(e, where, "qk_rope_head_dim", false));
    } else if (attention == "gqa") {
      m.mla = false;
      MOAT_ASSIGN_OR_RETURN(m.num_key_value_heads, integer(e, where, "num_key_value_heads"));
      MOAT_ASSIGN_OR_RETURN(m.head_dim, integer(e, where, "head_dim"));
    } else {
      return make_error("{}: field 'attention': expected \"mla\" or \"gqa\", got \"{}\"", where, attention);
    }
    m.default_precision = Precision::bf16;
  }
  if (e.contains("max_context")) {
    MOAT_ASSIGN_OR_RETURN(m.max_context, integer(e, where, "max_context"));
  }
  if (e.contains("default_precision")) {
    if (!e["default_precision"].is_string())
      return make_error("{}: field 'default_precision': expected a string", where);
    auto p = parse_precision(e["default_precision"].get<std::string>());
    if (!p) return make_error("{}: field 'default_precision': {}", where, p.error().message);
    m.default_precision = *p;
  }
  if (e.contains("recurrent_state_bytes_per_request")) {
    MOAT_ASSIGN_OR_RETURN(m.state_bytes_per_request, number(e, where, "recurrent_state_bytes_per_request", false));
  }
  m.state_split_by_tp = e.value("recurrent_state_split_by_tp", true);
  if (e.contains("estimated") && e["estimated"].is_array())
    for (const auto& f : e["estimated"])
      if (f.is_string()) m.estimated.push_back(f.get<std::string>());
  m.note = e.value("note", "");
  return m;
}

}  // namespace moat::plan
