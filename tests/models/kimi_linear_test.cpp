// Kimi Linear and Kimi K3's text model (KDA + MLA hybrids) beyond the golden logits of
// golden_test.cpp: a prompt prefilled
// in pieces of any size (across the chunked kernel's boundaries, and below its threshold, where
// the recurrent step runs) equals one pass; the state a request keeps after its prefill is the
// reference's, value for value (conv inputs and recurrent state). The engine over this model:
// tests/engine/kimi_linear_engine_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <span>

#include "golden_compare.h"
#include "loader/safetensors.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

const std::filesystem::path kGolden = std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden";

// A fixture and the prefill length its golden_decode.safetensors holds the state after.
struct Fixture {
  std::string name;
  int64_t prefill;
  int64_t layers, mla_layers, kda_layers;
};
const Fixture kKimiLinear{"tiny_kimi_linear", 35, 4, 2, 2};
const Fixture kK3{"tiny_k3", 20, 6, 2, 4};

std::map<std::string, std::vector<float>> read_f32_tensors(const std::filesystem::path& file,
                                                           std::vector<int32_t>* ids = nullptr) {
  auto st = SafetensorsFile::open(file);
  EXPECT_TRUE(st.ok()) << (st.ok() ? "" : st.error().message);
  std::map<std::string, std::vector<float>> out;
  if (!st.ok()) return out;
  for (const TensorInfo& t : (*st)->tensors()) {
    if (t.dtype == DType::F32) {
      const float* p = reinterpret_cast<const float*>(t.data);
      out[t.name].assign(p, p + t.numel());
    } else if (t.name == "input_ids" && ids) {
      const int32_t* p = reinterpret_cast<const int32_t*>(t.data);
      ids->assign(p, p + t.numel());
    }
  }
  return out;
}

using testing::rel_error;

std::unique_ptr<DeepseekModel> load(const Fixture& f, ops::Backend backend) {
  auto m = DeepseekModel::load(kGolden / f.name, {.backend = backend, .max_context = 256, .exact_activations = true,
                                          .kv_dtype = DType::F32, .threads = 1});
  EXPECT_TRUE(m.ok()) << m.error().message;
  return m.ok() ? std::move(m).value() : nullptr;
}

class KimiLinearTest : public ::testing::TestWithParam<std::tuple<Fixture, ops::Backend>> {
 protected:
  void SetUp() override {
    fixture_ = std::get<0>(GetParam());
    golden_ = read_f32_tensors(kGolden / fixture_.name / "golden.safetensors", &ids_);
    model_ = load(fixture_, std::get<1>(GetParam()));
    ASSERT_NE(model_, nullptr);
  }
  Fixture fixture_;
  std::vector<int32_t> ids_;
  std::map<std::string, std::vector<float>> golden_;
  std::unique_ptr<DeepseekModel> model_;
};

TEST_P(KimiLinearTest, ModelShape) {
  const DeepseekModel& m = *model_;
  EXPECT_EQ(m.num_layers(), fixture_.layers);
  EXPECT_EQ(m.cache_shape().num_layers, fixture_.mla_layers) << "the latent cache holds the MLA layers only";
  const auto& la = *m.config().linear_attn;
  EXPECT_EQ(m.state_bytes_per_request(),
            fixture_.kda_layers *
                (3 * (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim + la.num_heads * la.head_dim * la.head_dim) *
                4);
}

// Pieces of 1, 15, 16, 17 and the rest: the chunked kernel (>= 16 tokens) and the recurrent step
// both continue the state of the pieces before them; every piece's last logits are the reference's.
TEST_P(KimiLinearTest, PrefillInPiecesEqualsOnePass) {
  DeepseekModel& m = *model_;
  const int64_t T = static_cast<int64_t>(ids_.size()), V = m.config().vocab_size;
  const std::vector<float>& ref = golden_.at("logits");
  for (const std::vector<int64_t>& pieces : {std::vector<int64_t>{1, 7, 8, 9, T - 25}, {1, 15, 16, T - 32},
                                              {3, 33, T - 36}, {T - 1, 1}, {30, 2, 1, T - 33}}) {
    auto cache = m.new_sequence_cache(T, 8);
    std::vector<float> logits(static_cast<size_t>(V));
    int64_t pos = 0;
    for (int64_t n : pieces) {
      m.forward(cache, std::span(ids_).subspan(pos, n), static_cast<int32_t>(pos), logits.data());
      pos += n;
      EXPECT_LE(rel_error(logits.data(), &ref[(pos - 1) * V], V), 1e-3) << "after a piece ending at " << pos;
    }
  }
}

// The state slot after prefilling the golden's first tokens (35, 20) holds exactly the reference's
// conv inputs ([W-1, width], oldest first) and recurrent state ([heads, K, V]) per KDA layer.
TEST_P(KimiLinearTest, StateAfterPrefillIsTheReferences) {
  std::vector<int32_t> decode_ids;
  const auto states = read_f32_tensors(kGolden / fixture_.name / "golden_decode.safetensors", &decode_ids);
  ASSERT_EQ(decode_ids, ids_);
  DeepseekModel& m = *model_;
  const int64_t prefill = fixture_.prefill;
  auto cache = m.new_sequence_cache(prefill, 8);
  m.forward(cache, std::span(ids_).first(prefill), 0, nullptr, ForwardBatch::Logits::none);
  const float* slot = reinterpret_cast<const float*>(cache.states.data(cache.state_slot));
  const int64_t per_layer = m.config().kda_state_floats_per_layer();
  const auto& la = *m.config().linear_attn;
  const int64_t conv = (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim;
  int64_t kda_index = 0;
  for (int64_t layer = 0; layer < m.num_layers(); ++layer) {
    if (!m.config().is_kda_layer(layer)) continue;
    const float* base = slot + kda_index++ * per_layer;
    const std::string p = "state.prefill.layer" + std::to_string(layer) + ".";
    const std::pair<const char*, const float*> parts[] = {
        {"conv_q", base}, {"conv_k", base + conv}, {"conv_v", base + 2 * conv}, {"recurrent", base + 3 * conv}};
    for (const auto& [name, got] : parts) {
      const std::vector<float>& ref = states.at(p + name);
      EXPECT_LE(rel_error(got, ref.data(), ref.size()), 1e-4) << p + name;
    }
  }
  EXPECT_EQ(kda_index, fixture_.kda_layers);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, KimiLinearTest,
                         ::testing::Combine(::testing::Values(kKimiLinear, kK3),
                                            ::testing::Values(ops::Backend::reference, ops::Backend::cpu)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" +
                                  std::string(ops::backend_name(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace moat
