// `moat plan` sizes a config.json from the architecture's weight spec: on the committed
// checkpoints its parameter and byte totals are what the files hold (MTP layers aside), and an
// architecture the model registry does not know is refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include "loader/checkpoint.h"
#include "models/registry.h"
#include "plan/model_size.h"

namespace moat::plan {
namespace {

namespace fs = std::filesystem;

bool is_mtp(const std::string& name, int64_t num_layers) {
  const std::string p = "model.layers.";
  return name.rfind(p, 0) == 0 && std::stoll(name.substr(p.size())) >= num_layers;
}

TEST(ModelSizeFromSpec, TotalsEqualTheCheckpoints) {
  const fs::path root = MOAT_SOURCE_DIR;
  int checked = 0;
  // tiny_fp8 is block-scaled fp8 with bf16 embeddings, norms and router, as plan's fp8 assumes;
  // models/k3-nano is K3-shaped: MXFP4 routed experts, the rest bf16 (F32 KDA vectors); the
  // others are bf16 throughout.
  for (const fs::path& dir : {root / "tests/golden/tiny_qlora", root / "tests/golden/tiny_v2lite",
                             root / "tests/golden/tiny_fp8", root / "models/k3-nano"}) {
    if (!fs::exists(dir / "config.json")) continue;
    SCOPED_TRACE(dir.string());
    auto config = load_model_config(dir);
    ASSERT_TRUE(config.ok()) << config.error().message;
    auto size = size_from_config(*config, dir.string(), dir.filename().string());
    ASSERT_TRUE(size.ok()) << size.error().message;
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
    double params = 0, bytes = 0;
    for (const std::string& name : ckpt->names()) {
      if (is_mtp(name, config->num_hidden_layers)) continue;
      const TensorInfo* t = ckpt->find(name);
      // plan counts every non-Linear tensor as bf16; the checkpoints (like DeepSeek-V3's) keep
      // e_score_correction_bias in fp32: E x layers x 2 bytes short (31 KB of V3's 671 GB), and
      // k3-nano (like tiny_k3) KDA's A_log, dt_bias, short-conv weights and o_norm (30 KB here).
      const bool f32_bias = t->dtype == DType::F32 && !name.ends_with("_scale_inv");
      bytes += static_cast<double>(t->numel() * (f32_bias ? 2 : static_cast<int64_t>(dtype_size(t->dtype))));
      // 4-bit experts: two values a byte in weight_packed; weight_scale (one per 32) like _scale_inv.
      if (name.ends_with(".weight_packed")) params += 2.0 * static_cast<double>(t->numel());
      else if (!name.ends_with("_scale_inv") && !name.ends_with(".weight_scale")) params += static_cast<double>(t->numel());
    }
    EXPECT_EQ(size->total_params, params);
    EXPECT_EQ(size->weight_bytes[static_cast<int>(size->default_precision)], bytes);
    ++checked;
  }
  EXPECT_GE(checked, 3) << "the committed fixtures are missing";
}

TEST(ModelSizeFromSpec, UnknownArchitectureIsRefused) {
  ModelConfig c;
  c.architecture = "MixtralForCausalLM";
  auto size = size_from_config(c, "x", "x");
  ASSERT_FALSE(size.ok());
  EXPECT_NE(size.error().message.find("'MixtralForCausalLM' is not supported; supported: [" +
                                      supported_architectures_list() + "]"),
            std::string::npos)
      << size.error().message;
}

}  // namespace
}  // namespace moat::plan

namespace moat::plan {
namespace {

// A compressed-tensors 4-bit checkpoint sizes at its own precision, not fp8's.
TEST(ModelSizeFromSpec, CompressedTensorsConfigsDefaultToTheir4BitPrecision) {
  auto config = load_model_config(fs::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_qlora");
  ASSERT_TRUE(config.ok()) << config.error().message;
  for (const auto& [type, format, want] : {std::tuple{"float", "mxfp4-pack-quantized", Precision::mxfp4},
                                           {"int", "pack-quantized", Precision::int4}}) {
    const nlohmann::json q = {{"quant_method", "compressed-tensors"},
                              {"format", format},
                              {"config_groups",
                               {{"group_0",
                                 {{"weights",
                                   {{"num_bits", 4}, {"type", type}, {"strategy", "group"}, {"group_size", 32}}}}}}}};
    ModelConfig c = *config;
    c.quantization = parse_compressed_tensors_quantization(q).value();
    auto size = size_from_config(c, "x", "x");
    ASSERT_TRUE(size.ok()) << size.error().message;
    EXPECT_EQ(size->default_precision, want) << format;
  }
}

}  // namespace
}  // namespace moat::plan
