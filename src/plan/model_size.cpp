#include "plan/model_size.h"

#include <algorithm>
#include <cmath>

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

// Running totals while walking the tensors of a config.
struct Tally {
  double params = 0, active_params = 0;
  PerPrecision bytes{}, active_bytes{}, routed_bytes{};

  // A linear weight [rows, cols], `count` copies, `active` of which each token uses.
  void linear(int64_t rows, int64_t cols, double count, double active, bool routed = false) {
    const double n = static_cast<double>(rows) * cols;
    params += count * n;
    active_params += active * n;
    for (int i = 0; i < kNumPrecisions; ++i) {
      const double b = matrix_bytes(rows, cols, static_cast<Precision>(i));
      bytes[i] += count * b;
      active_bytes[i] += active * b;
      if (routed) routed_bytes[i] += count * b;
    }
  }
  // Stays bf16 whatever the precision (embeddings, lm_head, norms, routers). read_per_token is
  // false for the embedding table: decode reads one row of it.
  void bf16(double n, bool read_per_token = true) {
    params += n;
    active_params += n;
    for (int i = 0; i < kNumPrecisions; ++i) {
      bytes[i] += 2 * n;
      if (read_per_token) active_bytes[i] += 2 * n;
    }
  }
};

}  // namespace

ModelSize size_from_config(const ModelConfig& c, std::string id, std::string name) {
  Tally t;
  const int64_t H = c.hidden_size, heads = c.num_attention_heads;
  t.bf16(static_cast<double>(c.vocab_size) * H, /*read_per_token=*/false);  // embed_tokens
  if (!c.tie_word_embeddings) t.bf16(static_cast<double>(c.vocab_size) * H);  // lm_head
  t.bf16(static_cast<double>(H));                                            // final norm
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    t.bf16(2.0 * H);  // input_layernorm, post_attention_layernorm
    // MLA projections.
    if (c.q_lora_rank) {
      t.linear(*c.q_lora_rank, H, 1, 1);                     // q_a_proj
      t.bf16(static_cast<double>(*c.q_lora_rank));           // q_a_layernorm
      t.linear(heads * c.qk_head_dim(), *c.q_lora_rank, 1, 1);  // q_b_proj
    } else {
      t.linear(heads * c.qk_head_dim(), H, 1, 1);  // q_proj
    }
    t.linear(c.kv_lora_rank + c.qk_rope_head_dim, H, 1, 1);                  // kv_a_proj_with_mqa
    t.bf16(static_cast<double>(c.kv_lora_rank));                             // kv_a_layernorm
    t.linear(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, 1, 1);  // kv_b_proj
    t.linear(H, heads * c.v_head_dim, 1, 1);                                 // o_proj
    if (c.is_moe_layer(layer)) {
      const int64_t I = c.moe_intermediate_size;
      const double E = static_cast<double>(c.n_routed_experts), k = static_cast<double>(c.num_experts_per_tok);
      // gate_proj, up_proj [I, H] and down_proj [H, I] per routed expert.
      t.linear(I, H, 2 * E, 2 * k, /*routed=*/true);
      t.linear(H, I, E, k, /*routed=*/true);
      if (c.n_shared_experts > 0) {  // one MLP of width I x n_shared, used by every token
        const int64_t S = I * c.n_shared_experts;
        t.linear(S, H, 2, 2);
        t.linear(H, S, 1, 1);
      }
      t.bf16(E * H + E);  // router gate [E, H] + e_score_correction_bias
    } else {
      t.linear(c.intermediate_size, H, 2, 2);
      t.linear(H, c.intermediate_size, 1, 1);
    }
  }
  ModelSize m;
  m.id = std::move(id);
  m.name = std::move(name);
  m.total_params = t.params;
  m.active_params = t.active_params;
  m.weight_bytes = t.bytes;
  m.active_weight_bytes = t.active_bytes;
  m.routed_expert_bytes = t.routed_bytes;
  m.n_routed_experts = c.n_routed_experts;
  m.experts_per_token = c.num_experts_per_tok;
  m.num_attention_heads = heads;
  m.mla = true;
  m.kv_layers = c.num_hidden_layers;
  m.kv_lora_rank = c.kv_lora_rank;
  m.qk_rope_head_dim = c.qk_rope_head_dim;
  m.state_bytes_per_request = 0;
  m.max_context = c.max_position_embeddings;
  m.default_precision = c.quantization ? Precision::fp8 : Precision::bf16;
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
    m = size_from_config(*config, id, name);
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
