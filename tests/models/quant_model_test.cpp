// A DeepSeek-V3-shaped model whose routed experts are stored packed (compressed-tensors MXFP4 or
// INT4, as Kimi K3 and Kimi K2-Thinking ship them) runs end to end: config parse, per-tensor
// loader, op resolution (matmul and moe_experts in the 4-bit dtype) and the forward pass. Built
// from tests/golden/tiny_qlora with moe_intermediate_size 32 (4-bit groups need in % 32 == 0) and
// new random experts; its twin stores the same experts as bf16 holding exactly the dequantized
// values (MXFP4 codes times a power of two are exact in bf16; the INT4 twin uses power-of-two
// scales for the same reason). With exact activations the two must give the same logits up to
// fp32 summation order, on the reference and the cpu backends.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>

#include "loader/safetensors.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kSource = fs::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_qlora";

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = fs::temp_directory_path() / ("moat_quant_model_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

// One [out, in] expert matrix quantized to 4 bits with power-of-two scales: the packed tensors
// and the exact dequantized values.
struct Quantized {
  std::vector<uint8_t> packed, scales;  // [out, in/2]; [out, in/32] e8m0 bytes or bf16
  std::vector<float> values;            // [out, in], exactly what the packed form decodes to
};

Quantized quantize(DType dtype, int64_t out, int64_t in, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(in)));
  Quantized q;
  q.packed.assign(static_cast<size_t>(out * in / 2), 0);
  q.values.resize(static_cast<size_t>(out * in));
  const float* table = int4_code_table(dtype);
  const float top = dtype == DType::MXFP4 ? 6.0f : 7.0f;
  for (int64_t r = 0; r < out; ++r)
    for (int64_t g = 0; g < in / 32; ++g) {
      float w[32], amax = 0.0f;
      for (float& v : w) amax = std::max(amax, std::fabs(v = n(rng)));
      const int e = static_cast<int>(std::ceil(std::log2(std::max(amax, 1e-6f) / top)));  // scale 2^e
      const float scale = std::ldexp(1.0f, e);
      if (dtype == DType::MXFP4) {
        q.scales.push_back(static_cast<uint8_t>(e + 127));
      } else {
        const uint16_t b = f32_to_bf16(scale);
        q.scales.push_back(static_cast<uint8_t>(b & 0xff));
        q.scales.push_back(static_cast<uint8_t>(b >> 8));
      }
      for (int j = 0; j < 32; ++j) {
        int best = 0;  // the nearest code
        for (int c = 1; c < 16; ++c)
          if (std::fabs(table[c] * scale - w[j]) < std::fabs(table[best] * scale - w[j])) best = c;
        const int64_t col = 32 * g + j;
        q.packed[static_cast<size_t>((r * in + col) / 2)] |= static_cast<uint8_t>(best << (col % 2 ? 4 : 0));
        q.values[static_cast<size_t>(r * in + col)] = table[best] * scale;
      }
    }
  return q;
}

// Writes the packed model (dir_q) and its bf16 twin (dir_b) from tiny_qlora.
void make_pair(DType dtype, const fs::path& dir_q, const fs::path& dir_b) {
  json config = json::parse(std::ifstream(kSource / "config.json"));
  const int64_t H = config["hidden_size"], I = 32, layers = config["num_hidden_layers"];
  config["moe_intermediate_size"] = I;
  config["num_nextn_predict_layers"] = 0;
  std::ofstream(dir_b / "config.json") << config.dump(2);
  config["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", dtype == DType::MXFP4 ? "mxfp4-pack-quantized" : "pack-quantized"},
      {"config_groups",
       {{"group_0",
         {{"targets", {"Linear"}},
          {"weights",
           {{"num_bits", 4}, {"type", dtype == DType::MXFP4 ? "float" : "int"}, {"strategy", "group"}, {"group_size", 32},
            {"symmetric", true}}}}}}},
      {"ignore", {"lm_head"}}};
  std::ofstream(dir_q / "config.json") << config.dump(2);

  auto src = SafetensorsFile::open(kSource / "model.safetensors");
  ASSERT_TRUE(src.ok()) << src.error().message;
  std::vector<TensorToWrite> quant, plain;
  std::mt19937 rng(31);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (const TensorInfo& t : (*src)->tensors()) {
    const std::string& name = t.name;
    if (name.rfind("model.layers." + std::to_string(layers) + ".", 0) == 0) continue;  // the MTP layer
    const bool expert = name.find(".mlp.experts.") != std::string::npos;
    const bool shared = name.find(".mlp.shared_experts.") != std::string::npos;
    if (!expert && !shared) {
      TensorToWrite w{name, t.dtype, t.shape, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(t.data), reinterpret_cast<const uint8_t*>(t.data) + t.nbytes)};
      quant.push_back(w);
      plain.push_back(std::move(w));
      continue;
    }
    const bool down = name.find("down_proj") != std::string::npos;
    const int64_t out = down ? H : I, in = down ? I : H;
    if (shared) {  // bf16 in both, new shape
      std::vector<float> v(static_cast<size_t>(out * in));
      for (float& x : v) x = n(rng) / std::sqrt(static_cast<float>(in));
      TensorToWrite w{name, DType::BF16, {out, in}, bf16_bytes(v)};
      quant.push_back(w);
      plain.push_back(std::move(w));
      continue;
    }
    Quantized q = quantize(dtype, out, in, rng);
    plain.push_back({name, DType::BF16, {out, in}, bf16_bytes(q.values)});
    if (dtype == DType::MXFP4) {
      quant.push_back({name + "_packed", DType::U8, {out, in / 2}, q.packed});
      quant.push_back({name + "_scale", DType::U8, {out, in / 32}, q.scales});
    } else {
      // INT4 stores q + 8; the code table index is already the stored nibble
      quant.push_back({name + "_packed", DType::I32, {out, in / 8}, q.packed});
      quant.push_back({name + "_scale", DType::BF16, {out, in / 32}, q.scales});
      std::vector<uint8_t> shape(16);
      const int64_t s[2] = {out, in};
      std::memcpy(shape.data(), s, 16);
      quant.push_back({name + "_shape", DType::I64, {2}, shape});
    }
  }
  ASSERT_TRUE(write_safetensors(dir_q / "model.safetensors", quant).ok());
  ASSERT_TRUE(write_safetensors(dir_b / "model.safetensors", plain).ok());
}

double rel_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double d = 0.0, m = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, static_cast<double>(std::fabs(got[i] - ref[i])));
    m = std::max(m, static_cast<double>(std::fabs(ref[i])));
  }
  return d / std::max(m, 1e-30);
}

// Logits of a 12-token prefill and 4 decode steps.
std::vector<float> run(DeepseekModel& m) {
  const std::vector<int32_t> ids = {5, 17, 300, 42, 7, 99, 256, 3, 400, 11, 64, 128, 77, 23, 501, 9};
  const int64_t V = m.config().vocab_size, prefill = 12;
  auto cache = m.new_sequence_cache(static_cast<int64_t>(ids.size()), 4);
  std::vector<float> all(static_cast<size_t>(prefill * V)), step(static_cast<size_t>(V));
  const std::span<const int32_t> s(ids);
  m.forward(cache, s.first(prefill), 0, all.data(), ForwardBatch::Logits::all);
  for (int64_t t = prefill; t < static_cast<int64_t>(ids.size()); ++t) {
    m.forward(cache, s.subspan(t, 1), static_cast<int32_t>(t), step.data());
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

TEST(QuantModel, PackedExpertsMatchTheirBf16Twin) {
  for (DType dtype : {DType::MXFP4, DType::INT4_G32}) {
    TempDir q(std::string(dtype_name(dtype)) + "_q"), b(std::string(dtype_name(dtype)) + "_b");
    make_pair(dtype, q.path(), b.path());
    for (ops::Backend backend : {ops::Backend::reference, ops::Backend::cpu}) {
      const DeepseekModel::Options opt{.backend = backend, .max_context = 64, .exact_activations = true,
                                       .kv_dtype = DType::F32};
      auto mq = DeepseekModel::load(q.path(), opt);
      ASSERT_TRUE(mq.ok()) << mq.error().message;
      auto mb = DeepseekModel::load(b.path(), opt);
      ASSERT_TRUE(mb.ok()) << mb.error().message;
      ASSERT_TRUE((*mq)->config().quantization.has_value());
      EXPECT_EQ((*mq)->config().quantization->weight_dtype, dtype);
      int resolved = 0;
      for (const ops::ResolvedOp& r : (*mq)->ops().resolved())
        if ((r.op == ops::OpId::matmul || r.op == ops::OpId::moe_experts) && r.shape.weight_dtype == dtype) {
          EXPECT_TRUE(r.resolution.usable()) << r.use;
          ++resolved;
        }
      EXPECT_EQ(resolved, 2) << "matmul and moe_experts in " << dtype_name(dtype);
      // 4-bit experts stream half a byte per weight plus scales: fewer bytes than the bf16 twin
      EXPECT_LT((*mq)->active_weights_per_token().bytes, (*mb)->active_weights_per_token().bytes);
      const auto got = run(**mq), want = run(**mb);
      EXPECT_LE(rel_error(got, want), 1e-5) << dtype_name(dtype) << " on " << ops::backend_name(backend);
    }
  }
}

}  // namespace
}  // namespace moat
