// Compares moat's forward pass with the PyTorch reference (tools/reference_model.py) through the
// committed fixtures in tests/golden/. Tolerance (tests/golden/README.md): the argmax is identical
// at every position, and max |moat - ref| <= 1e-3 * max |ref| for the logits and for each stored
// hidden state. Checked for a full prefill, and for a prefill of half the tokens followed by
// one-token decode steps over the latent cache (the absorbed path the server runs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <map>
#include <span>

#include "golden_compare.h"
#include "loader/safetensors.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

constexpr double kRelTolerance = testing::kGoldenRelTolerance;
const std::filesystem::path kRoot = MOAT_SOURCE_DIR;
using testing::expect_logits_match;
using testing::Golden;
using testing::read_golden;
using testing::rel_error;
std::filesystem::path model_dir_for(const std::string& name) { return testing::golden_model_dir(name); }

// Loads the fixture's golden data and its model on the parameter's backend (skips when the
// fixture is absent).
class GoldenTest : public ::testing::TestWithParam<std::tuple<std::string, ops::Backend>> {
 protected:
  void SetUp() override {
    const auto& [name, backend] = GetParam();
    const auto golden_file = kRoot / "tests/golden" / name / "golden.safetensors";
    if (!std::filesystem::exists(golden_file) || !std::filesystem::exists(model_dir_for(name) / "config.json"))
      GTEST_SKIP() << "no fixture for " << name;
    g = read_golden(golden_file);
    // exact activations: held to 1e-3 (the default's bf16 activations have their own test below)
    // and an fp32 latent cache: the reference keeps its cache in fp32 (bf16 and fp8 caches have
    // their own test below)
    auto loaded = DeepseekModel::load(model_dir_for(name), {.backend = backend,
                                                            .max_context = 256,
                                                            .exact_activations = true,
                                                            .kv_dtype = DType::F32});
    ASSERT_TRUE(loaded.ok()) << loaded.error().message;
    model = std::move(loaded).value();
  }

  Golden g;
  std::unique_ptr<DeepseekModel> model;
};

TEST_P(GoldenTest, PrefillMatchesReference) {
  DeepseekModel& m = *model;
  const int64_t T = static_cast<int64_t>(g.ids.size()), V = m.config().vocab_size, H = m.config().hidden_size;
  ASSERT_EQ(static_cast<int64_t>(g.logits.size()), T * V);

  auto cache = m.new_sequence_cache(T);
  std::vector<float> logits(static_cast<size_t>(T * V));
  std::map<int64_t, std::vector<float>> hidden;
  m.forward(cache, g.ids, 0, logits.data(), ForwardBatch::Logits::all, [&](int64_t layer, const float* x, int64_t n) {
    hidden[layer].assign(x, x + n * H);
  });
  for (const auto& [layer, ref] : g.hidden) {
    ASSERT_EQ(hidden[layer].size(), ref.size());
    EXPECT_LE(rel_error(hidden[layer].data(), ref.data(), ref.size()), kRelTolerance) << "hidden after layer " << layer;
  }
  for (int64_t t = 0; t < T; ++t)
    expect_logits_match(&logits[t * V], &g.logits[t * V], V, "position " + std::to_string(t));
}

TEST_P(GoldenTest, DecodeOverLatentCacheMatchesReference) {
  DeepseekModel& m = *model;
  const int64_t T = static_cast<int64_t>(g.ids.size()), V = m.config().vocab_size;
  // Blocks of 4 rows: every sequence here spans several blocks.
  auto cache = m.new_sequence_cache(T, 4);
  const int64_t prefill = T / 2;
  std::vector<float> logits(static_cast<size_t>(V));
  const std::span<const int32_t> ids(g.ids);
  m.forward(cache, ids.first(prefill), 0, logits.data());
  expect_logits_match(logits.data(), &g.logits[(prefill - 1) * V], V, "prefill last");
  for (int64_t t = prefill; t < T; ++t) {
    m.forward(cache, ids.subspan(t, 1), static_cast<int32_t>(t), logits.data());
    expect_logits_match(logits.data(), &g.logits[t * V], V, "decode position " + std::to_string(t));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, GoldenTest,
    ::testing::Combine(::testing::Values("tiny_qlora", "tiny_v2lite", "tiny_fp8", "tiny_kimi_linear", "tiny_k3", "k3_nano",
                                         "k3_nano_draft"),
                       ::testing::Values(ops::Backend::reference, ops::Backend::cpu)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::string(ops::backend_name(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace moat

namespace moat {
namespace {

// The latent cache in bf16 (the default, as GPU engines store KV) and in fp8 e4m3 with a per-row
// scale, with exact activations so only the cache's rounding differs from the reference: the
// logits after a prefill of half the prompt and decode steps over the cache. bf16 rounds each
// cached value by up to 2^-9 relative, which moves logits by ~2-4e-3 of their largest magnitude
// on these fixtures (measured; over the 1e-3 an fp32 cache holds), never the top-1; fp8's 2^-4
// moves them more and can flip near-ties and expert choices.
TEST(KvCacheDtype, Bf16AndFp8StayCloseToReference) {
  for (const char* name : {"tiny_qlora", "tiny_v2lite", "tiny_fp8", "k3_nano"}) {
    Golden g = read_golden(kRoot / "tests/golden" / name / "golden.safetensors");
    for (DType kv : {DType::BF16, DType::F8_E4M3}) {
      auto model = DeepseekModel::load(
          model_dir_for(name), {.backend = ops::Backend::cpu, .max_context = 256, .exact_activations = true, .kv_dtype = kv});
      ASSERT_TRUE(model.ok()) << model.error().message;
      DeepseekModel& m = **model;
      const int64_t T = static_cast<int64_t>(g.ids.size()), V = m.config().vocab_size;
      auto top1 = [V](const float* v) { return std::max_element(v, v + V) - v; };
      auto cache = m.new_sequence_cache(T, 16);
      std::vector<float> logits(static_cast<size_t>(V));
      const int64_t prefill = T / 2;
      const std::span<const int32_t> ids(g.ids);
      double worst = 0.0;
      int agree = 0;
      m.forward(cache, ids.first(prefill), 0, logits.data());
      for (int64_t t = prefill; t < T; ++t) {
        m.forward(cache, ids.subspan(t, 1), static_cast<int32_t>(t), logits.data());
        worst = std::max(worst, rel_error(logits.data(), &g.logits[t * V], V));
        agree += top1(logits.data()) == top1(&g.logits[t * V]);
      }
      const int64_t checked = T - prefill;
      std::printf("kv %s %s: worst relative logit error %.4f, top-1 agreement %d/%ld\n", dtype_name(kv).data(), name,
                  worst, agree, checked);
      if (kv == DType::BF16) {
        EXPECT_LE(worst, 1e-2) << name;
        EXPECT_EQ(agree, checked) << name;
      } else {
        // measured 0.08-0.34 (a flipped expert choice on the sensitive tiny fixtures) and 46/48 top-1;
        // a wrong row scale or code decode moves logits by O(1) and flips most positions
        EXPECT_LE(worst, 0.5) << name;
        EXPECT_GE(agree, checked * 3 / 4) << name;
      }
    }
  }
}

// The default activations are bf16 in prefill matmuls (> 16 tokens) and against fp8 weights
// (W8A16); decode on bf16 weights stays exact. The fixtures are built to be sensitive (fan-in init,
// close routing gaps), so a bf16 rounding can flip an expert choice and move one position's logits
// a lot (worst relative error on the AMX Xeon, 2026-12-02: 0.012 tiny_qlora, 0.044 tiny_v2lite, 0.016
// tiny_fp8; with AMX attention's queries rounded to bf16 instead of split, 0.88 and 3 top-1 flips);
// what must hold is top-1 agreement almost everywhere, through the default prefill (fp8 chunks
// dequantized to bf16) and decode (fp8 decoded in registers) paths. A wrong scale block or a bad
// code decode moves logits by O(1) and flips most positions.
TEST(DefaultActivations, StayCloseToReference) {
  for (const char* name : {"tiny_qlora", "tiny_v2lite", "tiny_fp8"}) {
    Golden g = read_golden(kRoot / "tests/golden" / name / "golden.safetensors");
    auto model = DeepseekModel::load(kRoot / "tests/golden" / name, {.backend = ops::Backend::cpu, .max_context = 256});
    ASSERT_TRUE(model.ok()) << model.error().message;
    DeepseekModel& m = **model;
    const int64_t T = static_cast<int64_t>(g.ids.size()), V = m.config().vocab_size;
    ASSERT_GT(T, 16) << name << ": the full prefill must take the bf16 path";
    auto top1 = [V](const float* v) { return std::max_element(v, v + V) - v; };
    double worst = 0.0;
    int agree = 0;
    auto check = [&](const float* got, int64_t t) {
      worst = std::max(worst, rel_error(got, &g.logits[t * V], V));
      agree += top1(got) == top1(&g.logits[t * V]);
    };
    {  // full prefill
      auto cache = m.new_sequence_cache(T);
      std::vector<float> logits(static_cast<size_t>(T * V));
      m.forward(cache, g.ids, 0, logits.data(), ForwardBatch::Logits::all);
      for (int64_t t = 0; t < T; ++t) check(&logits[t * V], t);
    }
    {  // decode steps after half the prompt
      auto cache = m.new_sequence_cache(T);
      std::vector<float> logits(static_cast<size_t>(V));
      const int64_t prefill = T / 2;
      const std::span<const int32_t> ids(g.ids);
      m.forward(cache, ids.first(prefill), 0, logits.data());
      for (int64_t t = prefill; t < T; ++t) {
        m.forward(cache, ids.subspan(t, 1), static_cast<int32_t>(t), logits.data());
        check(logits.data(), t);
      }
    }
    const int64_t checked = T + (T - T / 2);
    std::printf("default activations %s: worst relative logit error %.4f, top-1 agreement %d/%ld\n", name, worst,
                agree, checked);
    EXPECT_GE(agree, checked - 2) << name;
  }
}

}  // namespace
}  // namespace moat
