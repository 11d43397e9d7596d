// The MTP head (DeepseekModel::Options::mtp) against the PyTorch reference's MTPLayer through
// tests/golden/<name>/golden_mtp.safetensors: the main model's final normed hidden states it reads
// (ForwardExtras::final_hidden), then the head's logits and output states at every position
// (input: the reference's hidden state of each position and the next token). Tolerance as the
// main golden test: max |moat - ref| <= 1e-3 * max |ref|, and top-1 identical where the reference's
// top two are further apart than that.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "loader/safetensors.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

const std::filesystem::path kRoot = MOAT_SOURCE_DIR;

std::map<std::string, std::vector<float>> read_floats(const std::filesystem::path& file, std::vector<int32_t>& ids) {
  auto st = SafetensorsFile::open(file);
  EXPECT_TRUE(st.ok()) << (st.ok() ? "" : st.error().message);
  std::map<std::string, std::vector<float>> out;
  for (const TensorInfo& t : (*st)->tensors()) {
    if (t.name == "input_ids")
      ids.assign(reinterpret_cast<const int32_t*>(t.data), reinterpret_cast<const int32_t*>(t.data) + t.numel());
    else
      out[t.name].assign(reinterpret_cast<const float*>(t.data), reinterpret_cast<const float*>(t.data) + t.numel());
  }
  return out;
}

double rel_error(const float* got, const float* ref, size_t n) {
  double diff = 0.0, mag = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - ref[i])));
    mag = std::max(mag, static_cast<double>(std::fabs(ref[i])));
  }
  return diff / std::max(mag, 1e-30);
}

class MtpGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(MtpGolden, HeadMatchesTheReference) {
  const auto dir = kRoot / "tests/golden" / GetParam();
  std::vector<int32_t> ids;
  auto g = read_floats(dir / "golden_mtp.safetensors", ids);
  const DeepseekModel::Options o{.backend = ops::Backend::cpu, .max_context = 64, .exact_activations = true,
                                 .kv_dtype = DType::F32};
  auto target = DeepseekModel::load(dir, o);
  ASSERT_TRUE(target.ok()) << target.error().message;
  DeepseekModel::Options mo = o;
  mo.mtp = true;
  auto head = DeepseekModel::load(dir, mo);
  ASSERT_TRUE(head.ok()) << head.error().message;
  const int64_t T = static_cast<int64_t>(ids.size()), H = (*target)->config().hidden_size;
  const int64_t V = (*target)->config().vocab_size;
  ASSERT_EQ(static_cast<int64_t>(g["final_hidden"].size()), T * H);

  // the main model's final hidden states, every row
  SequenceCache cache = (*target)->new_sequence_cache(T, 8);
  std::vector<float> final_hidden(static_cast<size_t>(T * H)), logits(static_cast<size_t>(V));
  (*target)->forward(ForwardBatch::for_sequence(ids, 0, cache.blocks, 8), cache.pages, logits.data(), nullptr,
                     {.final_hidden = final_hidden.data()});
  EXPECT_LE(rel_error(final_hidden.data(), g["final_hidden"].data(), final_hidden.size()), 1e-3);

  // the head over positions 0..T-2: the reference's h_p and token p + 1
  const int64_t n = T - 1;
  SequenceCache mtp_cache = (*head)->new_sequence_cache(n, 8);
  EXPECT_EQ(mtp_cache.pages.shape().num_layers, 1);
  std::vector<float> mtp_logits(static_cast<size_t>(n * V)), state(static_cast<size_t>(n * H));
  const std::vector<int32_t> next(ids.begin() + 1, ids.end());
  (*head)->forward(ForwardBatch::for_sequence(next, 0, mtp_cache.blocks, 8, ForwardBatch::Logits::all), mtp_cache.pages,
                   mtp_logits.data(), nullptr, {.mtp_prev_hidden = g["final_hidden"].data(), .residual = state.data()});
  const std::vector<float>& ref = g["logits"];
  EXPECT_LE(rel_error(mtp_logits.data(), ref.data(), ref.size()), 1e-3);
  EXPECT_LE(rel_error(state.data(), g["hidden"].data(), state.size()), 1e-3);
  double scale = 0.0;
  for (float v : ref) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  int compared = 0;
  for (int64_t p = 0; p < n; ++p) {
    const float* r = ref.data() + p * V;
    std::vector<float> sorted(r, r + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] <= 2e-3 * scale) continue;  // a near tie may flip within tolerance
    const float* m = mtp_logits.data() + p * V;
    EXPECT_EQ(std::max_element(m, m + V) - m, std::max_element(r, r + V) - r) << "position " << p;
    ++compared;
  }
  EXPECT_GT(compared, n / 2);

  // one position at a time over the paged cache (the chained-guess path) gives the same logits
  SequenceCache step_cache = (*head)->new_sequence_cache(n, 8);
  std::vector<float> one(static_cast<size_t>(V));
  for (int64_t p = 0; p < n; ++p) {
    (*head)->forward(ForwardBatch::for_sequence({&next[p], 1}, static_cast<int32_t>(p), step_cache.blocks, 8),
                     step_cache.pages, one.data(), nullptr, {.mtp_prev_hidden = g["final_hidden"].data() + p * H});
    EXPECT_LE(rel_error(one.data(), ref.data() + p * V, static_cast<size_t>(V)), 1e-3) << "position " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, MtpGolden, ::testing::Values("tiny_qlora", "tiny_fp8"));

}  // namespace
}  // namespace moat
