// Hostile config.json files: each test takes a real config (tests/golden/tiny_qlora), changes one
// field to a zero, negative, absurd or inconsistent value, writes it into a temp directory and
// checks that load_model_config refuses it naming the file, the field and what was expected.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "config/model_config.h"

namespace moat {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

const fs::path kRoot = MOAT_SOURCE_DIR;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class HostileConfig : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moat_hostile_config_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    base_ = ojson::parse(read_text(kRoot / "tests/golden/tiny_qlora/config.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `text` as config.json and returns the load error ("(loaded)" when it loads).
  std::string load_text(const std::string& text) {
    std::ofstream(dir_ / "config.json", std::ios::binary | std::ios::trunc) << text;
    auto c = load_model_config(dir_);
    return c.ok() ? std::string("(loaded)") : c.error().message;
  }
  // The base config with one field set (or removed, for a null `value` with `erase`).
  std::string load_with(const std::string& field, const ojson& value) {
    ojson j = base_;
    j[field] = value;
    return load_text(j.dump(2));
  }
  std::string file() const { return (dir_ / "config.json").string() + ": "; }

  fs::path dir_;
  ojson base_;
};

TEST_F(HostileConfig, TheBaseConfigAndEveryShippedConfigLoad) {
  EXPECT_EQ(load_text(base_.dump()), "(loaded)");
  for (const char* dir : {"tests/golden/tiny_qlora", "tests/golden/tiny_fp8", "tests/golden/tiny_v2lite",
                          "models/k3-nano", "models/k3-nano-draft"}) {
    auto c = load_model_config(kRoot / dir);
    EXPECT_TRUE(c.ok()) << dir << ": " << c.error().message;
  }
}

TEST_F(HostileConfig, ZeroAttentionHeads) {
  EXPECT_HAS(load_with("num_attention_heads", 0),
             file() + "config field 'num_attention_heads': expected > 0, got 0");
}

TEST_F(HostileConfig, NegativeHiddenSize) {
  EXPECT_HAS(load_with("hidden_size", -192), file() + "config field 'hidden_size': expected > 0, got -192");
}

TEST_F(HostileConfig, VocabOfTwoToTheForty) {
  EXPECT_HAS(load_with("vocab_size", int64_t{1} << 40),
             file() + "config field 'vocab_size': 1099511627776 is beyond any real model (at most 16777216)");
}

TEST_F(HostileConfig, AbsurdHiddenSize) {
  EXPECT_HAS(load_with("hidden_size", int64_t{1} << 32),
             file() + "config field 'hidden_size': 4294967296 is beyond any real model (at most 1048576)");
}

TEST_F(HostileConfig, AbsurdLayerCountAndPositions) {
  EXPECT_HAS(load_with("num_hidden_layers", 1000000), "config field 'num_hidden_layers': 1000000 is beyond");
  // RoPE tables are sized by the context: 2^40 positions would be terabytes
  EXPECT_HAS(load_with("max_position_embeddings", int64_t{1} << 40),
             "config field 'max_position_embeddings': 1099511627776 is beyond any real model");
}

TEST_F(HostileConfig, SizesThatTogetherDescribeAnAbsurdModel) {
  // Each field under its own bound; together 4000 layers x 65536 experts x 3 x 2^20 x 2^16.
  ojson j = base_;
  j["num_hidden_layers"] = 4000;
  j["n_routed_experts"] = 65536;
  j["n_group"] = 1;
  j["topk_group"] = 1;
  j["hidden_size"] = 1 << 20;
  j["moe_intermediate_size"] = 1 << 16;
  const std::string e = load_text(j.dump());
  EXPECT_HAS(e, file() + "config: the sizes describe");
  EXPECT_HAS(e, "parameters, over 1e+14: a size field is wrong (hidden_size 1048576, num_hidden_layers 4000");
}

TEST_F(HostileConfig, ZeroKvLoraRank) {
  EXPECT_HAS(load_with("kv_lora_rank", 0), file() + "config field 'kv_lora_rank': expected > 0, got 0");
}

TEST_F(HostileConfig, ZeroQLoraRank) {
  EXPECT_HAS(load_with("q_lora_rank", 0), file() + "config field 'q_lora_rank': expected > 0, got 0");
}

TEST_F(HostileConfig, MoreExpertsPerTokenThanExperts) {
  EXPECT_HAS(load_with("num_experts_per_tok", 1000),
             file() + "config field 'num_experts_per_tok': expected <= n_routed_experts");
}

TEST_F(HostileConfig, ExpertsNotDivisibleIntoGroups) {
  ojson j = base_;
  j["n_group"] = 3;  // tiny_qlora: 8 experts
  EXPECT_HAS(load_text(j.dump()), "config field 'n_group': n_routed_experts (8) must be divisible by n_group");
}

TEST_F(HostileConfig, OddRopeHeadDim) {
  EXPECT_HAS(load_with("qk_rope_head_dim", 15), file() + "config field 'qk_rope_head_dim': expected an even number");
}

TEST_F(HostileConfig, RopeThetaOfOne) {
  EXPECT_HAS(load_with("rope_theta", 1.0), file() + "config field 'rope_theta': expected > 1, got 1");
}

TEST_F(HostileConfig, ZeroYarnBeta) {
  ojson j = base_;
  ASSERT_TRUE(j.contains("rope_scaling") && j["rope_scaling"].is_object());
  j["rope_scaling"]["beta_fast"] = 0;
  EXPECT_HAS(load_text(j.dump()),
             file() + "config field 'rope_scaling.beta_fast': expected a finite number > 0, got 0");
}

TEST_F(HostileConfig, NegativeRmsNormEps) {
  EXPECT_HAS(load_with("rms_norm_eps", -1e-6), file() + "config field 'rms_norm_eps': expected > 0");
}

TEST_F(HostileConfig, EosIdOutsideTheVocabulary) {
  EXPECT_HAS(load_with("eos_token_id", ojson::array({1, 512})),
             file() + "config field 'eos_token_id': expected ids in [0, vocab_size 512), got [1,512]");
  EXPECT_HAS(load_with("bos_token_id", -1),
             file() + "config field 'bos_token_id': expected an id in [0, vocab_size 512), got -1");
}

TEST_F(HostileConfig, IntegerPastInt64) {
  EXPECT_HAS(load_with("hidden_size", uint64_t{18446744073709551615u}),
             file() + "config field 'hidden_size': 18446744073709551615 does not fit in a 64-bit integer");
}

// Fuzz finding: a number past double threw nlohmann out_of_range through the parse_error catch.
TEST_F(HostileConfig, NumberPastDoubleIsAnErrorNotACrash) {
  std::string text = base_.dump();
  text.insert(1, "\"rope_theta\": 1e400, ");
  const std::string e = load_text(text);
  EXPECT_HAS(e, file() + "invalid JSON");
  EXPECT_HAS(e, "number overflow");
}

TEST_F(HostileConfig, WrongTypesAndShapes) {
  EXPECT_HAS(load_with("hidden_size", "192"), "config field 'hidden_size': expected an integer, got string \"192\"");
  EXPECT_HAS(load_with("hidden_size", 191.5), "config field 'hidden_size': expected an integer, got number 191.5");
  EXPECT_HAS(load_text("[1, 2]"), file() + "config: expected a JSON object at the top level, got array");
  ojson j = base_;
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {0, 128}}};
  EXPECT_HAS(load_text(j.dump()), "'quantization_config.weight_block_size': expected two positive integers");
}

}  // namespace
}  // namespace moat
