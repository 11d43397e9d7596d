#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "config/model_config.h"

namespace moat {
namespace {

using nlohmann::json;

// The published config.json files (HF bookkeeping such as auto_map left out; the parser
// ignores it). deepseek-ai/DeepSeek-V3:
constexpr char kDeepSeekV3[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

// deepseek-ai/DeepSeek-V2-Lite: q_lora_rank null, softmax greedy routing, no quantization.
constexpr char kDeepSeekV2Lite[] = R"({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})";

// moonshotai/Kimi-K2-Instruct: V3 architecture, model_type kimi_k2, one expert group.
constexpr char kKimiK2Instruct[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.48.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 163840
})";

ModelConfig parse_ok(const json& j) {
  auto c = parse_model_config(j);
  EXPECT_TRUE(c.ok()) << c.error().message;
  return c.ok() ? c.value() : ModelConfig{};
}

// Applies `edit` to the V3 config and returns the parse error ("" when it parses).
template <class Edit>
std::string v3_error(Edit edit) {
  json j = json::parse(kDeepSeekV3);
  edit(j);
  auto c = parse_model_config(j);
  return c.ok() ? std::string() : c.error().message;
}

TEST(ModelConfig, DeepSeekV3) {
  ModelConfig c = parse_ok(json::parse(kDeepSeekV3));
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.num_key_value_heads, 128);
  ASSERT_TRUE(c.q_lora_rank.has_value());
  EXPECT_EQ(*c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.kv_cache_dim(), 576);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 40.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 1.0);
  ASSERT_TRUE(c.quantization.has_value());
  EXPECT_EQ(c.quantization->quant_method, "fp8");
  EXPECT_EQ(c.quantization->fmt, "e4m3");
  EXPECT_EQ(c.quantization->activation_scheme, "dynamic");
  EXPECT_EQ(c.quantization->block_out, 128);
  EXPECT_EQ(c.quantization->block_in, 128);
  ASSERT_TRUE(c.bos_token_id.has_value());
  EXPECT_EQ(*c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_EQ(c.torch_dtype, DType::BF16);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(60));
  // 192^-0.5 * (0.1 * ln 40 + 1)^2
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-12);
  EXPECT_NEAR(c.softmax_scale(), 0.1352337788608801, 1e-9);
}

TEST(ModelConfig, DeepSeekV2Lite) {
  ModelConfig c = parse_ok(json::parse(kDeepSeekV2Lite));
  EXPECT_EQ(c.architecture, "DeepseekV2ForCausalLM");
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_EQ(c.vocab_size, 102400);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 10944);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_FALSE(c.quantization.has_value());
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 0.707);
  EXPECT_EQ(*c.bos_token_id, 100000);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({100001}));
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-12);
}

TEST(ModelConfig, KimiK2Instruct) {
  ModelConfig c = parse_ok(json::parse(kKimiK2Instruct));
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.model_type, "kimi_k2");
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.n_routed_experts, 384);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_DOUBLE_EQ(c.rope_theta, 50000.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(*c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({163585}));
  EXPECT_EQ(c.kv_cache_dim(), 576);
  const double m = 0.1 * std::log(32.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(192.0), 1e-12);
}

TEST(ModelConfig, AbsentFieldsTakeHfDefaults) {
  // Only the required fields: everything else comes from DeepseekV3Config's defaults.
  ModelConfig v3 = parse_ok(json{{"architectures", {"DeepseekV3ForCausalLM"}},
                                 {"vocab_size", 1000},
                                 {"hidden_size", 64},
                                 {"num_hidden_layers", 4},
                                 {"num_attention_heads", 4}});
  EXPECT_EQ(v3.model_type, "deepseek_v3");
  EXPECT_EQ(v3.intermediate_size, 18432);
  EXPECT_EQ(v3.moe_intermediate_size, 2048);
  EXPECT_EQ(*v3.q_lora_rank, 1536);
  EXPECT_EQ(v3.kv_lora_rank, 512);
  EXPECT_EQ(v3.n_routed_experts, 256);
  EXPECT_EQ(v3.n_group, 8);
  EXPECT_EQ(v3.topk_group, 4);
  EXPECT_EQ(v3.first_k_dense_replace, 3);
  EXPECT_DOUBLE_EQ(v3.routed_scaling_factor, 2.5);
  EXPECT_TRUE(v3.norm_topk_prob);
  EXPECT_EQ(v3.topk_method, "noaux_tc");
  EXPECT_EQ(v3.scoring_func, "sigmoid");
  EXPECT_EQ(v3.max_position_embeddings, 4096);
  EXPECT_EQ(v3.num_nextn_predict_layers, 1);
  EXPECT_EQ(*v3.bos_token_id, 0);
  EXPECT_EQ(v3.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_FALSE(v3.rope_scaling.has_value());
  EXPECT_FALSE(v3.quantization.has_value());
  EXPECT_DOUBLE_EQ(v3.softmax_scale(), 1.0 / std::sqrt(192.0));

  // DeepseekV2Config: MoE fields default to None, i.e. a dense model with softmax greedy routing.
  ModelConfig v2 = parse_ok(json{{"architectures", {"DeepseekV2ForCausalLM"}},
                                 {"vocab_size", 1000},
                                 {"hidden_size", 64},
                                 {"num_hidden_layers", 4},
                                 {"num_attention_heads", 4}});
  EXPECT_EQ(v2.model_type, "deepseek_v2");
  EXPECT_EQ(v2.intermediate_size, 11008);
  EXPECT_EQ(v2.moe_intermediate_size, 1407);
  EXPECT_EQ(v2.n_routed_experts, 0);
  EXPECT_FALSE(v2.is_moe_layer(3));
  EXPECT_EQ(v2.topk_method, "greedy");
  EXPECT_EQ(v2.scoring_func, "softmax");
  EXPECT_FALSE(v2.norm_topk_prob);
  EXPECT_EQ(v2.max_position_embeddings, 2048);
  EXPECT_EQ(*v2.bos_token_id, 100000);
}

TEST(ModelConfig, NullMoeFieldsMeanDenseAndOneGroup) {
  json j = json::parse(kDeepSeekV2Lite);
  j["n_routed_experts"] = nullptr;
  j["n_group"] = nullptr;
  j["topk_group"] = nullptr;
  j["num_experts_per_tok"] = nullptr;
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.n_routed_experts, 0);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_FALSE(c.is_moe_layer(5));
}

TEST(ModelConfig, EosListRopeTypeAndDtypeSpellings) {
  json j = json::parse(kDeepSeekV3);
  j["eos_token_id"] = {1, 7, 9};
  j["rope_scaling"].erase("type");
  j["rope_scaling"]["rope_type"] = "yarn";
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  ModelConfig c = parse_ok(j);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1, 7, 9}));
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_EQ(c.torch_dtype, DType::F16);

  j["rope_scaling"] = nullptr;
  j["quantization_config"] = nullptr;
  c = parse_ok(j);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_FALSE(c.quantization.has_value());
}

TEST(ModelConfig, YarnMscale) {
  EXPECT_DOUBLE_EQ(yarn_get_mscale(1.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(40.0, 1.0), 0.1 * std::log(40.0) + 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(40.0, 0.707), 0.0707 * std::log(40.0) + 1.0);
}

TEST(ModelConfig, SoftmaxScaleIgnoresZeroMscaleAllDimAndUnitFactor) {
  json j = json::parse(kDeepSeekV3);
  j["rope_scaling"]["mscale_all_dim"] = 0;
  EXPECT_DOUBLE_EQ(parse_ok(j).softmax_scale(), 1.0 / std::sqrt(192.0));
  j["rope_scaling"]["mscale_all_dim"] = 1.0;
  j["rope_scaling"]["factor"] = 1.0;
  EXPECT_DOUBLE_EQ(parse_ok(j).softmax_scale(), 1.0 / std::sqrt(192.0));
}

TEST(ModelConfigErrors, UnknownArchitectureListsSupported) {
  std::string e = v3_error([](json& j) { j["architectures"] = {"LlamaForCausalLM"}; });
  EXPECT_NE(e.find("architectures"), std::string::npos) << e;
  EXPECT_NE(e.find("LlamaForCausalLM"), std::string::npos) << e;
  EXPECT_NE(e.find("DeepseekV3ForCausalLM"), std::string::npos) << e;
  EXPECT_NE(e.find("DeepseekV2ForCausalLM"), std::string::npos) << e;
  e = v3_error([](json& j) { j.erase("architectures"); });
  EXPECT_NE(e.find("'architectures' is missing"), std::string::npos) << e;
}

TEST(ModelConfigErrors, ModelTypeMustMatchArchitecture) {
  std::string e = v3_error([](json& j) { j["model_type"] = "llama"; });
  EXPECT_NE(e.find("model_type"), std::string::npos) << e;
  EXPECT_NE(e.find("deepseek_v3, kimi_k2"), std::string::npos) << e;
}

TEST(ModelConfigErrors, MissingRequiredField) {
  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"}) {
    std::string e = v3_error([&](json& j) { j.erase(key); });
    EXPECT_NE(e.find(std::string("'") + key + "' is missing"), std::string::npos) << e;
  }
}

TEST(ModelConfigErrors, WrongFieldType) {
  std::string e = v3_error([](json& j) { j["hidden_size"] = "7168"; });
  EXPECT_NE(e.find("'hidden_size': expected an integer"), std::string::npos) << e;
  e = v3_error([](json& j) { j["norm_topk_prob"] = 1; });
  EXPECT_NE(e.find("'norm_topk_prob': expected true or false"), std::string::npos) << e;
  e = v3_error([](json& j) { j["eos_token_id"] = "</s>"; });
  EXPECT_NE(e.find("'eos_token_id'"), std::string::npos) << e;
}

TEST(ModelConfigErrors, NonPositiveHeads) {
  std::string e = v3_error([](json& j) { j["num_attention_heads"] = 0; });
  EXPECT_NE(e.find("'num_attention_heads': expected > 0, got 0"), std::string::npos) << e;
  e = v3_error([](json& j) { j["num_attention_heads"] = -4; });
  EXPECT_NE(e.find("'num_attention_heads': expected > 0, got -4"), std::string::npos) << e;
}

TEST(ModelConfigErrors, ExpertsNotDivisibleByGroups) {
  std::string e = v3_error([](json& j) { j["n_group"] = 7; });
  EXPECT_NE(e.find("'n_group'"), std::string::npos) << e;
  EXPECT_NE(e.find("divisible"), std::string::npos) << e;
}

TEST(ModelConfigErrors, TopkGroupAboveGroups) {
  std::string e = v3_error([](json& j) { j["topk_group"] = 9; });
  EXPECT_NE(e.find("'topk_group': expected <= n_group (8), got 9"), std::string::npos) << e;
}

TEST(ModelConfigErrors, MoreExpertsPerTokenThanExperts) {
  std::string e = v3_error([](json& j) { j["num_experts_per_tok"] = 300; });
  EXPECT_NE(e.find("'num_experts_per_tok': expected <= n_routed_experts (256), got 300"),
            std::string::npos)
      << e;
}

TEST(ModelConfigErrors, MoreExpertsPerTokenThanTheChosenGroupsHold) {
  // 8 groups of 32 experts, 1 chosen group: at most 32 experts reachable.
  std::string e = v3_error([](json& j) {
    j["topk_group"] = 1;
    j["num_experts_per_tok"] = 40;
  });
  EXPECT_NE(e.find("reaches only"), std::string::npos) << e;
}

TEST(ModelConfigErrors, NoauxTcNeedsSigmoid) {
  std::string e = v3_error([](json& j) { j["scoring_func"] = "softmax"; });
  EXPECT_NE(e.find("'scoring_func': topk_method noaux_tc expects \"sigmoid\""),
            std::string::npos)
      << e;
}

TEST(ModelConfigErrors, UnknownTopkMethodAndScoringFunc) {
  std::string e = v3_error([](json& j) { j["topk_method"] = "gready"; });
  EXPECT_NE(e.find("'topk_method': expected one of noaux_tc, greedy, group_limited_greedy"),
            std::string::npos)
      << e;
  e = v3_error([](json& j) { j["scoring_func"] = "relu"; });
  EXPECT_NE(e.find("'scoring_func': expected sigmoid or softmax"), std::string::npos) << e;
}

TEST(ModelConfigErrors, UnknownRopeScaling) {
  std::string e = v3_error([](json& j) { j["rope_scaling"]["type"] = "linear"; });
  EXPECT_NE(e.find("'rope_scaling.type': expected \"yarn\""), std::string::npos) << e;
  EXPECT_NE(e.find("linear"), std::string::npos) << e;
  e = v3_error([](json& j) { j["rope_scaling"].erase("factor"); });
  EXPECT_NE(e.find("'rope_scaling.factor' is missing"), std::string::npos) << e;
  e = v3_error([](json& j) { j["rope_scaling"]["factor"] = 0.5; });
  EXPECT_NE(e.find("'rope_scaling.factor': expected a number >= 1"), std::string::npos) << e;
}

TEST(ModelConfigErrors, QuantizationMustBeFp8E4m3WithTwoBlockSizes) {
  std::string e = v3_error([](json& j) { j["quantization_config"]["quant_method"] = "awq"; });
  EXPECT_NE(e.find("'quantization_config.quant_method': expected \"fp8\""), std::string::npos)
      << e;
  EXPECT_NE(e.find("awq"), std::string::npos) << e;
  e = v3_error([](json& j) { j["quantization_config"]["fmt"] = "e5m2"; });
  EXPECT_NE(e.find("'quantization_config.fmt': expected \"e4m3\""), std::string::npos) << e;
  e = v3_error([](json& j) { j["quantization_config"]["weight_block_size"] = {128}; });
  EXPECT_NE(e.find("'quantization_config.weight_block_size'"), std::string::npos) << e;
}

TEST(ModelConfigErrors, UnknownTorchDtype) {
  std::string e = v3_error([](json& j) { j["torch_dtype"] = "int8"; });
  EXPECT_NE(e.find("'torch_dtype'"), std::string::npos) << e;
}

TEST(ModelConfigErrors, OddRopeHeadDim) {
  std::string e = v3_error([](json& j) { j["qk_rope_head_dim"] = 63; });
  EXPECT_NE(e.find("'qk_rope_head_dim': expected an even number"), std::string::npos) << e;
}

TEST(ModelConfigFile, LoadsFromDirectoryAndNamesFileInErrors) {
  const auto dir = std::filesystem::temp_directory_path() / "moat_config_test";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << kKimiK2Instruct;
  }
  auto c = load_model_config(dir);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->model_type, "kimi_k2");
  auto c2 = load_model_config(dir / "config.json");
  ASSERT_TRUE(c2.ok()) << c2.error().message;

  {
    std::ofstream(dir / "bad.json") << "{\"architectures\": [";
  }
  auto bad = load_model_config(dir / "bad.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("bad.json: invalid JSON"), std::string::npos)
      << bad.error().message;

  auto missing = load_model_config(dir / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("nope"), std::string::npos);

  {
    json j = json::parse(kDeepSeekV3);
    j["n_group"] = 7;
    std::ofstream(dir / "invalid.json") << j.dump();
  }
  auto invalid = load_model_config(dir / "invalid.json");
  ASSERT_FALSE(invalid.ok());
  EXPECT_NE(invalid.error().message.find("invalid.json: config field 'n_group'"),
            std::string::npos)
      << invalid.error().message;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moat
