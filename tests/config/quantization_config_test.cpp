// compressed-tensors quantization_config -> QuantizationConfig: the published 4-bit layouts (Kimi
// K2-Thinking's int4 pack-quantized, format at the top level; Kimi K3's mxfp4-pack-quantized,
// format inside the config group) and the variants moat refuses, each naming its field.
#include <gtest/gtest.h>

#include <functional>

#include "config/model_config.h"
#include "config/quantization_config.h"

namespace moat {
namespace {

using nlohmann::json;

// The shape of Kimi-K2-Thinking's quantization_config (compressed-tensors, int4 routed experts).
json k2_thinking() {
  return json::parse(R"({
    "config_groups": {
      "group_0": {
        "input_activations": null,
        "output_activations": null,
        "targets": ["Linear"],
        "weights": {
          "actorder": null, "block_structure": null, "dynamic": false, "group_size": 32, "num_bits": 4,
          "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "int"
        }
      }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": null,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed"
  })");
}

// Kimi K3's: MXFP4, the format given in the config group.
json k3() {
  return json::parse(R"({
    "quant_method": "compressed-tensors",
    "config_groups": {
      "group_0": {
        "format": "mxfp4-pack-quantized",
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": true,
                    "dynamic": false}
      }
    },
    "ignore": ["lm_head"]
  })");
}

std::string error_of(json q) {
  auto r = parse_compressed_tensors_quantization(q);
  return r.ok() ? std::string("(parsed)") : r.error().message;
}

std::string edited(json (*base)(), const std::function<void(json&)>& edit) {
  json q = base();
  edit(q);
  return error_of(q);
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(QuantizationConfig, KimiK2ThinkingIsInt4GroupsOf32) {
  auto q = parse_compressed_tensors_quantization(k2_thinking());
  ASSERT_TRUE(q.ok()) << q.error().message;
  EXPECT_EQ(q->quant_method, "compressed-tensors");
  EXPECT_EQ(q->fmt, "pack-quantized");
  EXPECT_EQ(q->weight_dtype, DType::INT4_G32);
  ASSERT_EQ(q->ignore.size(), 4u);
  EXPECT_EQ(q->ignore[0], "lm_head");
}

TEST(QuantizationConfig, KimiK3IsMxfp4WithTheFormatInTheGroup) {
  auto q = parse_compressed_tensors_quantization(k3());
  ASSERT_TRUE(q.ok()) << q.error().message;
  EXPECT_EQ(q->weight_dtype, DType::MXFP4);
  EXPECT_EQ(q->fmt, "mxfp4-pack-quantized");
  // the same with the format at the top level
  json top = k3();
  top["format"] = "mxfp4-pack-quantized";
  top["config_groups"]["group_0"].erase("format");
  auto t = parse_compressed_tensors_quantization(top);
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->weight_dtype, DType::MXFP4);
}

TEST(QuantizationConfig, ThroughTheModelConfigParser) {
  // parse_quantization dispatches on quant_method; fp8 stays fp8
  json j = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"vocab_size", 32}, {"hidden_size", 16},
            {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"moe_intermediate_size", 32},
            {"intermediate_size", 32}, {"n_routed_experts", 4}, {"num_experts_per_tok", 2}, {"n_group", 1},
            {"topk_group", 1}};
  j["quantization_config"] = k3();
  auto c = parse_model_config(j);
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_TRUE(c->quantization.has_value());
  EXPECT_EQ(c->quantization->weight_dtype, DType::MXFP4);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  auto f = parse_model_config(j);
  ASSERT_TRUE(f.ok()) << f.error().message;
  EXPECT_EQ(f->quantization->weight_dtype, DType::F8_E4M3);
  EXPECT_EQ(f->quantization->fmt, "e4m3");
  j["quantization_config"] = {{"quant_method", "gptq"}};
  auto g = parse_model_config(j);
  ASSERT_FALSE(g.ok());
  EXPECT_HAS(g.error().message,
             "'quantization_config.quant_method': expected \"fp8\" (block-scaled e4m3) or \"compressed-tensors\"");
}

TEST(QuantizationConfigErrors, UnsupportedVariantsNameTheField) {
  const std::string w = "'quantization_config.config_groups.group_0.weights.";
  EXPECT_HAS(edited(k3, [](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; }),
             w + "num_bits': expected 4 (MXFP4 or INT4), got 8");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 128; }),
             w + "group_size': expected 32, got 128");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["symmetric"] = false; }),
             w + "symmetric': expected true");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "channel"; }),
             w + "strategy': expected \"group\"");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["dynamic"] = true; }),
             w + "dynamic': expected false");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["actorder"] = "group"; }),
             w + "actorder': expected null, \"static\" or \"weight\", got \"group\"");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "fp"; }),
             w + "type': expected \"float\" (MXFP4) or \"int\" (INT4), got \"fp\"");
  EXPECT_HAS(edited(k3,
                    [](json& q) {
                      q["config_groups"]["group_0"]["input_activations"] = {
                          {"num_bits", 8}, {"type", "float"}, {"strategy", "group"}, {"group_size", 32}, {"dynamic", true}};
                    }),
             "'quantization_config.config_groups.group_0.input_activations': activation quantization is not "
             "supported");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["format"] = "mxfp4-pack-quantized"; }),
             "'quantization_config.config_groups.group_0.format': 4-bit int weights need the format "
             "\"pack-quantized\", got \"mxfp4-pack-quantized\"");
  EXPECT_HAS(edited(k3, [](json& q) { q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"; }),
             "4-bit float weights need the format \"mxfp4-pack-quantized\", got \"nvfp4-pack-quantized\"");
  EXPECT_HAS(edited(k3, [](json& q) { q["config_groups"]["group_0"].erase("weights"); }),
             "'quantization_config.config_groups.group_0.weights': expected an object");
  EXPECT_HAS(edited(k3, [](json& q) { q["config_groups"] = json::object(); }),
             "'quantization_config.config_groups': expected a non-empty object");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["quantization_status"] = "frozen"; }),
             "'quantization_config.quantization_status': expected \"compressed\"");
  EXPECT_HAS(edited(k2_thinking, [](json& q) { q["ignore"] = "lm_head"; }),
             "'quantization_config.ignore': expected a list of module names");
  EXPECT_HAS(edited(k3,
                    [](json& q) {
                      q["config_groups"]["group_1"] = k2_thinking()["config_groups"]["group_0"];
                      q["config_groups"]["group_1"]["format"] = "pack-quantized";
                    }),
             "'quantization_config.config_groups': groups disagree (MXFP4 and INT4_G32)");
}

}  // namespace
}  // namespace moat
