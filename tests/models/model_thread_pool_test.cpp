// Each model owns its thread count (DeepseekModel::Options::threads): a draft and a target model
// with different counts alternate in one process, each forward runs on its own pool, and each
// gives exactly the logits it gives alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <span>
#include <thread>
#include <vector>

#include "base/thread_pool.h"
#include "models/deepseek_v3.h"

namespace moat {
namespace {

const std::filesystem::path kRoot = MOAT_SOURCE_DIR;

std::unique_ptr<DeepseekModel> load(const std::string& dir, int threads) {
  auto m = DeepseekModel::load(kRoot / dir, {.backend = ops::Backend::cpu, .max_context = 64, .threads = threads});
  EXPECT_TRUE(m.ok()) << m.error().message;
  return m.ok() ? std::move(m).value() : nullptr;
}

// One sequence: a 9-token prefill, then decode steps feeding back the argmax; every step's
// logits, in order. Records the pool size every layer of every forward ran with.
struct Sequence {
  DeepseekModel& model;
  SequenceCache cache;
  std::vector<int32_t> tokens = {3, 141, 59, 26, 535, 89, 79, 32, 38};
  std::vector<std::vector<float>> logits;
  std::vector<int> pool_sizes;

  explicit Sequence(DeepseekModel& m) : model(m), cache(m.new_sequence_cache(64, 4)) {}

  void step() {
    const int64_t V = model.config().vocab_size;
    std::vector<float> out(static_cast<size_t>(V));
    auto hook = [&](int64_t, const float*, int64_t) { pool_sizes.push_back(thread_pool().num_threads()); };
    const bool prefill = logits.empty();
    const int32_t first = prefill ? 0 : static_cast<int32_t>(tokens.size() - 1);
    const std::span<const int32_t> feed = prefill ? std::span<const int32_t>(tokens)
                                                  : std::span<const int32_t>(tokens).last(1);
    model.forward(cache, feed, first, out.data(), ForwardBatch::Logits::last, hook);
    tokens.push_back(static_cast<int32_t>(std::max_element(out.begin(), out.end()) - out.begin()));
    logits.push_back(std::move(out));
  }
};

TEST(ModelThreadPool, TwoModelsWithDifferentThreadCountsAlternateAsIfAlone) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano/config.json") ||
      !std::filesystem::exists(kRoot / "models/k3-nano-draft/config.json"))
    GTEST_SKIP() << "shipped models absent";
  constexpr int kTargetThreads = 3, kDraftThreads = 1, kSteps = 5;
  auto target = load("models/k3-nano", kTargetThreads);
  auto draft = load("models/k3-nano-draft", kDraftThreads);
  ASSERT_TRUE(target && draft);
  EXPECT_EQ(target->thread_pool().num_threads(), kTargetThreads);
  EXPECT_EQ(draft->thread_pool().num_threads(), kDraftThreads);

  Sequence target_alone(*target), draft_alone(*draft);
  for (int i = 0; i < kSteps; ++i) target_alone.step();
  for (int i = 0; i < kSteps; ++i) draft_alone.step();

  Sequence t(*target), d(*draft);
  for (int i = 0; i < kSteps; ++i) {
    d.step();
    t.step();
    d.step();  // the draft runs two steps per target step, as a proposer does
  }
  for (int i = kSteps; i < 2 * kSteps; ++i) draft_alone.step();
  ASSERT_EQ(t.logits.size(), target_alone.logits.size());
  ASSERT_EQ(d.logits.size(), draft_alone.logits.size());
  for (size_t i = 0; i < t.logits.size(); ++i) EXPECT_EQ(t.logits[i], target_alone.logits[i]) << "target step " << i;
  for (size_t i = 0; i < d.logits.size(); ++i) EXPECT_EQ(d.logits[i], draft_alone.logits[i]) << "draft step " << i;
  for (int n : t.pool_sizes) EXPECT_EQ(n, kTargetThreads);
  for (int n : d.pool_sizes) EXPECT_EQ(n, kDraftThreads);
  // Outside any forward the caller's pool is untouched by either model.
  EXPECT_NE(&thread_pool(), &target->thread_pool());
}

// Two models of one size share their pool (one set of workers, not two spinning against each
// other), and a forward on one thread does not change the pool another thread sees.
TEST(ModelThreadPool, SameSizeModelsShareOnePoolAndThreadsDoNotInterfere) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano-draft/config.json")) GTEST_SKIP() << "shipped models absent";
  auto a = load("models/k3-nano-draft", 2), b = load("models/k3-nano-draft", 2), c = load("models/k3-nano-draft", 1);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(&a->thread_pool(), &b->thread_pool());
  EXPECT_NE(&a->thread_pool(), &c->thread_pool());

  Sequence alone_a(*a), alone_c(*c);
  for (int i = 0; i < 4; ++i) alone_a.step(), alone_c.step();
  Sequence ra(*a), rc(*c);
  std::thread other([&] {
    for (int i = 0; i < 4; ++i) rc.step();
  });
  for (int i = 0; i < 4; ++i) ra.step();
  other.join();
  EXPECT_EQ(ra.logits, alone_a.logits);
  EXPECT_EQ(rc.logits, alone_c.logits);
  for (int n : ra.pool_sizes) EXPECT_EQ(n, 2);
  for (int n : rc.pool_sizes) EXPECT_EQ(n, 1);
}

}  // namespace
}  // namespace moat
