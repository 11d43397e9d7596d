// Weight matrices start on a cache line whatever the checkpoint's header length: tiny_v2lite's
// tensors sit 8 bytes past one (as a safetensors header padded to 8 bytes leaves them), so a
// mapped load copies them onto lines (Options::realign_weights) and a --no-mmap load reads the
// file to a shifted address instead. Either way the model computes exactly what it computes from
// the checkpoint's own bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "loader/safetensors.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

const std::filesystem::path kModel = std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_v2lite";

std::unique_ptr<DeepseekModel> load(WeightPlacement placement, bool realign,
                                    const std::filesystem::path& model = kModel) {
  auto m = DeepseekModel::load(model, {.max_context = 64, .weights = placement, .threads = 1, .realign_weights = realign});
  EXPECT_TRUE(m.ok()) << m.error().message;
  return m.ok() ? std::move(m).value() : nullptr;
}

// The matrices streamed per token (every matrix but the untied embedding, which is read a row at a
// time) and whether each starts on a cache line.
std::vector<std::pair<std::string, bool>> alignment_of_streamed(const DeepseekModel& m) {
  std::vector<std::pair<std::string, bool>> out;
  for (const TensorSpec& t : m.weight_spec().tensors) {
    if (!t.is_matrix() || t.part == Part::embedding) continue;
    const WeightMatrix* w = m.weight_matrix(t.name);
    EXPECT_NE(w, nullptr) << t.name;
    if (w) out.emplace_back(t.name, weight_aligned(w->data));
  }
  return out;
}

std::vector<float> logits_of(DeepseekModel& m) {
  const std::vector<int32_t> prompt = {1, 17, 42, 7, 99, 3, 250, 11};
  const int64_t V = m.config().vocab_size;
  auto cache = m.new_sequence_cache(16);
  std::vector<float> all(static_cast<size_t>(prompt.size() * V));
  m.forward(cache, prompt, 0, all.data(), ForwardBatch::Logits::all);
  std::vector<float> next(static_cast<size_t>(V));  // and one decode step over the latent cache
  const int32_t token = 5;
  m.forward(cache, std::span<const int32_t>(&token, 1), static_cast<int32_t>(prompt.size()), next.data());
  all.insert(all.end(), next.begin(), next.end());
  return all;
}

TEST(WeightAlignment, FixtureTensorsStartOffACacheLine) {
  // What the rest of this file relies on: without realigning, a mapped load leaves matrices off a line.
  auto m = load(WeightPlacement::mmap, /*realign=*/false);
  ASSERT_TRUE(m);
  int misaligned = 0;
  for (const auto& [name, aligned] : alignment_of_streamed(*m)) misaligned += !aligned;
  EXPECT_GT(misaligned, 0);
  EXPECT_EQ(m->realigned_weight_bytes(), 0);
}

TEST(WeightAlignment, MappedLoadCopiesMatricesOntoCacheLines) {
  auto m = load(WeightPlacement::mmap, /*realign=*/true);
  ASSERT_TRUE(m);
  EXPECT_GT(m->realigned_weight_bytes(), 0);
  for (const auto& [name, aligned] : alignment_of_streamed(*m)) EXPECT_TRUE(aligned) << name;
  // the copies hold the checkpoint's bytes
  for (const TensorSpec& t : m->weight_spec().tensors) {
    if (!t.is_matrix() || t.part == Part::embedding) continue;
    const TensorInfo* src = m->checkpoint().find(t.name);
    ASSERT_NE(src, nullptr) << t.name;
    const WeightMatrix* w = m->weight_matrix(t.name);
    if (src->dtype != DType::BF16 && src->dtype != DType::F8_E4M3) continue;  // converted at load
    EXPECT_EQ(std::memcmp(w->data, src->data, src->nbytes), 0) << t.name;
  }
}

TEST(WeightAlignment, InMemoryLoadShiftsTheImageInsteadOfCopying) {
  auto m = load(WeightPlacement::memory, /*realign=*/true);
  ASSERT_TRUE(m);
  for (const auto& [name, aligned] : alignment_of_streamed(*m)) EXPECT_TRUE(aligned) << name;
  EXPECT_EQ(m->realigned_weight_bytes(), 0) << "one header residue: the shifted image aligns every tensor";
}

TEST(WeightAlignment, RealignedWeightsComputeTheSameLogits) {
  auto as_stored = load(WeightPlacement::mmap, /*realign=*/false);
  auto realigned = load(WeightPlacement::mmap, /*realign=*/true);
  auto in_memory = load(WeightPlacement::memory, /*realign=*/true);
  ASSERT_TRUE(as_stored && realigned && in_memory);
  const std::vector<float> ref = logits_of(*as_stored);
  EXPECT_EQ(logits_of(*realigned), ref);
  EXPECT_EQ(logits_of(*in_memory), ref);
}

// tiny_fp8's shards put their tensors 8 and 32 bytes past a line, so its fp8 matrices move, and
// their scale_inv tensors move with them: read in the mapping, each would map a page of the file
// back in (in the FP8 bench checkpoint, 2 MiB per tensor: its RSS grew from 1.07x to 1.85x the
// checkpoint over a prefill and decode).
TEST(WeightAlignment, MovedFp8MatricesReadTheirScalesFromTheCopy) {
  const auto fp8_model = std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_fp8";
  auto realigned = load(WeightPlacement::mmap, true, fp8_model), as_stored = load(WeightPlacement::mmap, false, fp8_model);
  ASSERT_TRUE(realigned && as_stored);
  int moved = 0;
  for (const TensorSpec& t : realigned->weight_spec().tensors) {
    const WeightMatrix* w = t.is_matrix() ? realigned->weight_matrix(t.name) : nullptr;
    const TensorInfo* src = realigned->checkpoint().find(t.name);
    if (w == nullptr || w->dtype != DType::F8_E4M3 || src == nullptr || w->data == src->data) continue;
    const TensorInfo* scales = realigned->checkpoint().find(t.name + "_scale_inv");
    ASSERT_NE(scales, nullptr) << t.name;
    EXPECT_NE(static_cast<const void*>(w->scale_inv), scales->data) << t.name;
    EXPECT_EQ(std::memcmp(w->scale_inv, scales->data, scales->nbytes), 0) << t.name;
    ++moved;
  }
  EXPECT_GT(moved, 0);
  EXPECT_EQ(logits_of(*realigned), logits_of(*as_stored));
}

}  // namespace
}  // namespace moat
