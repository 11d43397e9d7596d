// KimiLinearForCausalLM configs: Kimi Linear's own key names land in the DeepSeek-named fields,
// layer kinds follow the 1-based linear_attn_config lists, and the state size is exact.
#include <gtest/gtest.h>

#include <filesystem>

#include "config/model_config.h"

namespace moat {
namespace {

using nlohmann::json;

// moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (HF bookkeeping such as auto_map left out).
constexpr char kKimiLinear48B[] = R"({
  "architectures": ["KimiLinearForCausalLM"],
  "model_type": "kimi_linear",
  "vocab_size": 163840,
  "hidden_size": 2304,
  "num_hidden_layers": 27,
  "num_attention_heads": 32,
  "num_key_value_heads": 32,
  "intermediate_size": 9216,
  "head_dim": 72,
  "model_max_length": 1048576,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "linear_attn_config": {
    "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    "num_heads": 32,
    "head_dim": 128,
    "short_conv_kernel_size": 4
  },
  "num_experts": 256,
  "moe_intermediate_size": 1024,
  "kv_lora_rank": 512,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "mla_use_nope": true,
  "num_experts_per_token": 8,
  "num_shared_experts": 1,
  "moe_router_activation_func": "sigmoid",
  "moe_renormalize": true,
  "routed_scaling_factor": 2.446,
  "first_k_dense_replace": 1,
  "moe_layer_freq": 1,
  "use_grouped_topk": true,
  "num_expert_group": 1,
  "topk_group": 1,
  "tie_word_embeddings": false,
  "num_nextn_predict_layers": 0,
  "torch_dtype": "bfloat16",
  "bos_token_id": 163584,
  "eos_token_id": 163585
})";

ModelConfig parse_ok(const json& j) {
  auto r = parse_model_config(j);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return r.ok() ? *r : ModelConfig{};
}

std::string error_of(void (*edit)(json&)) {
  json j = json::parse(kKimiLinear48B);
  edit(j);
  auto r = parse_model_config(j);
  EXPECT_FALSE(r.ok());
  return r.ok() ? std::string() : r.error().message;
}

TEST(KimiLinearConfig, Published48BConfig) {
  const ModelConfig c = parse_ok(json::parse(kKimiLinear48B));
  EXPECT_EQ(c.architecture, "KimiLinearForCausalLM");
  EXPECT_EQ(c.model_type, "kimi_linear");
  // Kimi's MoE keys in the DeepSeek-named fields
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_TRUE(c.mla_use_nope);
  EXPECT_EQ(c.max_position_embeddings, 1048576);  // from model_max_length
  EXPECT_EQ(c.kv_cache_dim(), 576);
  EXPECT_NEAR(c.softmax_scale(), 1.0 / std::sqrt(192.0), 1e-12);
  // 1-based layer lists: layer index 3 (id 4) is MLA, the last (26, id 27) too
  ASSERT_TRUE(c.linear_attn.has_value());
  EXPECT_EQ(c.num_kda_layers(), 20);
  EXPECT_EQ(c.num_mla_layers(), 7);
  EXPECT_TRUE(c.is_kda_layer(0));
  EXPECT_FALSE(c.is_kda_layer(3));
  EXPECT_TRUE(c.is_kda_layer(25));
  EXPECT_FALSE(c.is_kda_layer(26));
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  // State per request: 20 layers x (3 x 3 x 4096 conv inputs + 32 x 128 x 128 state) x 4 bytes
  EXPECT_EQ(c.kda_state_floats_per_layer(), 3 * 3 * 4096 + 32 * 128 * 128);
  EXPECT_EQ(c.state_bytes_per_request(), 20 * (3 * 3 * 4096 + 32 * 128 * 128) * 4);  // 44.9 MB (K3.md: ~43 MB, i.e. 42.8 MiB)
}

TEST(KimiLinearConfig, WithoutLinearAttentionEveryLayerIsMla) {
  const ModelConfig c = parse_ok([] {
    json j = json::parse(kKimiLinear48B);
    j.erase("linear_attn_config");
    return j;
  }());
  EXPECT_EQ(c.num_kda_layers(), 0);
  EXPECT_EQ(c.state_bytes_per_request(), 0);
}

TEST(KimiLinearConfigErrors, LayerListsAreCheckedAndOneBased) {
  std::string e = error_of([](json& j) { j["linear_attn_config"]["kda_layers"] = {0, 1}; });
  EXPECT_NE(e.find("layer id 0 outside 1..num_hidden_layers (27)"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"]["kda_layers"] = {1, 28}; });
  EXPECT_NE(e.find("28"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"]["kda_layers"] = {1, 4}; });
  EXPECT_NE(e.find("layer 4 is in both"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"]["kda_layers"] = {1, 1}; });
  EXPECT_NE(e.find("listed twice"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"]["num_heads"] = 0; });
  EXPECT_NE(e.find("linear_attn_config.num_heads"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"].erase("head_dim"); });
  EXPECT_NE(e.find("linear_attn_config.head_dim' is missing"), std::string::npos) << e;
  e = error_of([](json& j) { j["linear_attn_config"]["kda_layers"] = "1,2"; });
  EXPECT_NE(e.find("expected a list"), std::string::npos) << e;
}

// Kimi K3: the text model's config is text_config (a Kimi Linear config with K3's fields), its
// tensors sit under "language_model.". The fixture's config.json has the published key set.
TEST(KimiK3Config, TextConfigOfTheTinyFixture) {
  auto r = load_model_config(std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_k3");
  ASSERT_TRUE(r.ok()) << r.error().message;
  const ModelConfig& c = *r;
  EXPECT_EQ(c.architecture, "KimiK3ForConditionalGeneration");
  EXPECT_EQ(c.model_type, "kimi_k3");
  EXPECT_EQ(c.weight_prefix, "language_model.");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 6);
  EXPECT_EQ(c.attn_res_block_size, 2);
  EXPECT_EQ(c.routed_expert_hidden_size, 64);
  EXPECT_TRUE(c.latent_moe_use_norm);
  EXPECT_TRUE(c.mla_use_output_gate);
  EXPECT_TRUE(c.mla_use_nope);
  EXPECT_EQ(c.hidden_act, "situ");
  EXPECT_DOUBLE_EQ(c.situ_beta, 4.0);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, 25.0);
  ASSERT_TRUE(c.linear_attn.has_value());
  EXPECT_DOUBLE_EQ(c.linear_attn->gate_lower_bound, -5.0);
  EXPECT_TRUE(c.linear_attn->use_full_rank_gate);
  EXPECT_EQ(c.num_kda_layers(), 4);
  EXPECT_FALSE(c.is_kda_layer(2));
  EXPECT_FALSE(c.is_kda_layer(5));
  EXPECT_EQ(c.n_shared_experts, 2);
  ASSERT_TRUE(c.quantization.has_value());
  EXPECT_EQ(c.quantization->weight_dtype, DType::MXFP4);
}

TEST(KimiK3ConfigErrors, TextConfigProblemsAreNamed) {
  json k3 = {{"architectures", {"KimiK3ForConditionalGeneration"}}, {"model_type", "kimi_k3"}};
  auto r = parse_model_config(k3);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("text_config"), std::string::npos) << r.error().message;
  k3["text_config"] = json::parse(kKimiLinear48B);
  k3["text_config"]["hidden_act"] = "gelu";
  r = parse_model_config(k3);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("text_config: config field 'hidden_act'"), std::string::npos) << r.error().message;
  k3["text_config"]["hidden_act"] = "situ";
  k3["text_config"]["linear_attn_config"]["gate_lower_bound"] = 1.0;
  r = parse_model_config(k3);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("gate_lower_bound"), std::string::npos) << r.error().message;
}

TEST(KimiLinearConfigErrors, ModelTypeMustBeKimiLinear) {
  std::string e = error_of([](json& j) { j["model_type"] = "deepseek_v3"; });
  EXPECT_NE(e.find("kimi_linear"), std::string::npos) << e;
}

}  // namespace
}  // namespace moat
