// Small checkpoints written to a temp directory, for the loader tests and the weight-spec tests
// (tests/models): temp dirs, bf16/f32 tensor bytes, a shard index, and a tiny V3-shaped config.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "config/model_config.h"
#include "loader/safetensors.h"

namespace moat::testing_files {

namespace fs = std::filesystem;
using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("moat_test_files_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

inline std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

// A deterministic pattern of small, bf16-exact values.
inline std::vector<float> pattern(int64_t n, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + seed * 13) % 17 - 8) / 8.0f;
  return v;
}

inline TensorToWrite bf16_tensor(const std::string& name, std::vector<int64_t> shape, int seed = 0) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return {name, DType::BF16, std::move(shape), bf16_bytes(pattern(n, seed))};
}

inline void write_index(const fs::path& dir, const json& weight_map) {
  std::ofstream(dir / "model.safetensors.index.json")
      << json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
}

// A tiny V3-shaped model: layer 0 dense, layer 1 MoE (4 experts in 2 groups, noaux_tc).
inline ModelConfig tiny_config(bool fp8 = false, bool q_lora = true) {
  json j = {{"architectures", {"DeepseekV3ForCausalLM"}},
            {"model_type", "deepseek_v3"},
            {"vocab_size", 32},
            {"hidden_size", 16},
            {"intermediate_size", 24},
            {"moe_intermediate_size", 8},
            {"num_hidden_layers", 2},
            {"num_nextn_predict_layers", 1},
            {"num_attention_heads", 2},
            {"num_key_value_heads", 2},
            {"q_lora_rank", q_lora ? json(12) : json(nullptr)},
            {"kv_lora_rank", 8},
            {"qk_nope_head_dim", 4},
            {"qk_rope_head_dim", 2},
            {"v_head_dim", 4},
            {"n_routed_experts", 4},
            {"n_shared_experts", 1},
            {"num_experts_per_tok", 2},
            {"n_group", 2},
            {"topk_group", 1},
            {"first_k_dense_replace", 1}};
  if (fp8)
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {128, 128}}};
  auto c = parse_model_config(j);
  EXPECT_TRUE(c.ok()) << c.error().message;
  return c.value();
}

}  // namespace moat::testing_files

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

