// The engine over the Kimi Linear hybrid (tests/golden/tiny_kimi_linear): batching, chunked
// prefill, preemption and speculative decoding (the KDA state rewound past rejected guesses)
// change no token; prefix hits resume from snapshots of the state at block boundaries.
#include <gtest/gtest.h>

#include <filesystem>

#include <map>

#include "engine/engine.h"
#include "kv/state_pool.h"
#include "loader/safetensors.h"
#include "spec/draft_proposer.h"
#include "spec/proposer.h"
#include "run_engine.h"
#include "wrong_in_turn_proposer.h"

namespace moat {
namespace {

const std::filesystem::path kFixture = std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_kimi_linear";

std::unique_ptr<DeepseekModel> load(ops::Backend backend) {
  auto m = DeepseekModel::load(kFixture, {.backend = backend, .max_context = 256, .exact_activations = true,
                                          .kv_dtype = DType::F32, .threads = 1});
  EXPECT_TRUE(m.ok()) << m.error().message;
  return m.ok() ? std::move(m).value() : nullptr;
}

// The engine over a hybrid model: each request's state lives in its slot from admission to
// finish, so requests batched together with chunked prefill, or preempted and recomputed,
// generate exactly what they generate alone.
class KimiLinearEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = load(ops::Backend::cpu).release(); }
  static void TearDownTestSuite() { delete model_; }

  static std::unique_ptr<Engine> engine(EngineConfig c) {
    if (c.max_model_len == 0) c.max_model_len = 128;
    if (c.kv_memory_bytes == 0) c.kv_memory_bytes = 8 << 20;
    auto e = Engine::create(*model_, c, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().message;
    return e.ok() ? std::move(e).value() : nullptr;
  }
  static GenerateRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
    return testing::greedy(std::move(prompt), max_tokens);
  }
  std::vector<std::vector<int32_t>> prompts() const {
    std::vector<std::vector<int32_t>> p;
    for (int i = 0; i < 5; ++i) {
      std::vector<int32_t> ids;
      for (int j = 0; j < 3 + 9 * i; ++j) ids.push_back((37 * i + 11 * j + 5) % 500);
      p.push_back(ids);
    }
    return p;
  }
  static DeepseekModel* model_;
};
DeepseekModel* KimiLinearEngineTest::model_ = nullptr;

TEST_F(KimiLinearEngineTest, BatchedChunkedAndPreemptedRequestsGenerateWhatEachGeneratesAlone) {
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts()) {
    auto e = engine({});
    ASSERT_TRUE(e->add_request(greedy(p, 10)).ok());
    alone.push_back(testing::run_to_completion(*e).begin()->second.tokens);
    ASSERT_EQ(alone.back().size(), 10u);
  }
  // Five requests, 6 tokens per step: prompts are prefilled in chunks beside decoding requests.
  auto e = engine({.max_num_batched_tokens = 6});
  std::vector<uint64_t> ids;
  for (const auto& p : prompts()) ids.push_back(*e->add_request(greedy(p, 10)));
  auto done = testing::run_to_completion(*e);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "request " << i;
  EXPECT_EQ(e->scheduler().state_pool().num_free(), e->scheduler().state_pool().num_slots());

  // Room for 64 tokens of MLA cache, for requests needing 13 to 49: they are preempted (their
  // state slot given back) and recomputed from scratch.
  const int64_t per_token = model_->cache_shape().bytes_per_token();
  auto tight = engine({.block_size = 4, .kv_memory_bytes = 64 * per_token, .max_model_len = 64});
  ids.clear();
  for (const auto& p : prompts()) ids.push_back(*tight->add_request(greedy(p, 10)));
  done = testing::run_to_completion(*tight);
  EXPECT_GT(tight->scheduler().num_preemptions(), 0);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "request " << i;
}

// Every running request may touch its state slot at once: a --max-num-seqs whose states do not fit
// beside the KV cache is refused at creation with the numbers, not killed for memory later.
TEST_F(KimiLinearEngineTest, StateSlotsBeyondTheAvailableMemoryAreRefusedAtCreation) {
  const int64_t state = model_->state_bytes_per_request();
  const int64_t kv = 8 << 20;
  set_mem_available_for_testing(static_cast<uint64_t>(kv + 10 * state));
  EngineConfig c;
  c.max_model_len = 128;
  c.kv_memory_bytes = kv;
  c.max_num_seqs = 16;
  auto refused = Engine::create(*model_, c, nullptr);
  c.max_num_seqs = 8;
  auto fits = Engine::create(*model_, c, nullptr);
  set_mem_available_for_testing(std::nullopt);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("16 running requests (--max-num-seqs) keep " + std::to_string(state) +
                                         " bytes of recurrent state each"),
            std::string::npos)
      << refused.error().message;
  EXPECT_TRUE(fits.ok()) << fits.error().message;
}

// `moat plan` counts the snapshots' memory with default_state_snapshots: the engine must size its
// cache with the same rule (2 x --max-num-seqs, at most a quarter of the memory left after the KV
// cache and the running states).
TEST_F(KimiLinearEngineTest, DefaultSnapshotCountIsTheRulePlanCountsWith) {
  const int64_t state = model_->state_bytes_per_request();
  const int64_t kv = 8 << 20;
  EngineConfig c;
  c.max_model_len = 128;
  c.kv_memory_bytes = kv;
  c.max_num_seqs = 8;
  // 22 states' worth left beside the KV cache and 8 running states: a quarter is 5.5, so 5.
  set_mem_available_for_testing(static_cast<uint64_t>(kv + 8 * state + 22 * state));
  auto capped = Engine::create(*model_, c, nullptr);
  // Plenty left: the full 2 x 8.
  set_mem_available_for_testing(static_cast<uint64_t>(kv + 8 * state + 1000 * state));
  auto roomy = Engine::create(*model_, c, nullptr);
  set_mem_available_for_testing(std::nullopt);
  ASSERT_TRUE(capped.ok()) << capped.error().message;
  ASSERT_TRUE(roomy.ok()) << roomy.error().message;
  EXPECT_EQ((*capped)->scheduler().state_snapshots().capacity(), 5);
  EXPECT_EQ(default_state_snapshots(8, state, 22 * state), 5);
  EXPECT_EQ((*roomy)->scheduler().state_snapshots().capacity(), 16);
  EXPECT_EQ(default_state_snapshots(8, state, 1000 * state), 16);
  EXPECT_EQ(default_state_snapshots(8, state, std::nullopt), 16);  // memory unknown: no cap
  EXPECT_EQ(default_state_snapshots(8, state, -state), 0);          // nothing left: none
}

// A prefix hit must also restore the state where the prefix ends. The scheduler snapshots the
// state at block boundaries (cutting a prompt's last chunk at its last one), so a repeated prompt
// resumes from the snapshot and generates what it generates computed from scratch.
TEST_F(KimiLinearEngineTest, RepeatedPromptResumesFromTheStateSnapshot) {
  const auto p = prompts()[3];  // 30 tokens: the last block boundary before its end is 28
  auto fresh = engine({.block_size = 4, .enable_prefix_caching = false});
  const uint64_t f = *fresh->add_request(greedy(p, 6));
  const auto expected = testing::run_to_completion(*fresh)[f].tokens;

  auto e = engine({.block_size = 4, .enable_prefix_caching = true});
  const uint64_t a = *e->add_request(greedy(p, 6));
  auto first = testing::run_to_completion(*e);
  EXPECT_EQ(first[a].tokens, expected);
  EXPECT_EQ(first[a].last.cached_tokens, 0);
  const uint64_t b = *e->add_request(greedy(p, 6));
  auto second = testing::run_to_completion(*e);
  EXPECT_EQ(second[b].tokens, expected);
  EXPECT_EQ(second[b].last.cached_tokens, 28);
  EXPECT_EQ(e->scheduler().state_snapshots().counters().restores, 1);

  // Without snapshots there is nothing to resume from: no hit, same tokens.
  auto none = engine({.block_size = 4, .enable_prefix_caching = true, .prefix_state_snapshots = 0});
  for (int i = 0; i < 2; ++i) {
    const uint64_t id = *none->add_request(greedy(p, 6));
    auto done = testing::run_to_completion(*none);
    EXPECT_EQ(done[id].tokens, expected);
    EXPECT_EQ(done[id].last.cached_tokens, 0);
  }
}

// A conversation's next turn holds the previous turn's prompt and answer: it resumes from the
// deepest snapshot the answer's decoding left (every block boundary a step ended on), not just
// the prompt's.
TEST_F(KimiLinearEngineTest, NextTurnResumesFromTheDeepestSnapshotOfThePreviousAnswer) {
  const auto p = prompts()[3];
  auto e = engine({.block_size = 4});
  const uint64_t a = *e->add_request(greedy(p, 10));
  auto first = testing::run_to_completion(*e);
  // Computed: 30 prompt + 9 output tokens (the last one is sampled, never run): boundaries 32, 36.
  std::vector<int32_t> turn = p;
  turn.insert(turn.end(), first[a].tokens.begin(), first[a].tokens.end());
  for (int32_t t : {7, 70, 170, 270, 370}) turn.push_back(t);

  auto fresh = engine({.block_size = 4, .enable_prefix_caching = false});
  const uint64_t f = *fresh->add_request(greedy(turn, 8));
  const auto expected = testing::run_to_completion(*fresh)[f].tokens;
  const uint64_t b = *e->add_request(greedy(turn, 8));
  auto second = testing::run_to_completion(*e);
  EXPECT_EQ(second[b].tokens, expected);
  EXPECT_EQ(second[b].last.cached_tokens, 36);
}

// Snapshots are a bounded cache: the least recently used goes first, and a prefix whose
// snapshot is gone is computed again (from the deepest snapshot left, or from scratch).
TEST_F(KimiLinearEngineTest, EvictedSnapshotsCostRecomputationNeverTokens) {
  const auto all = prompts();
  auto e = engine({.block_size = 4, .prefix_state_snapshots = 2});
  std::map<size_t, std::vector<int32_t>> expected;
  for (size_t i : {3u, 4u}) {
    auto fresh = engine({.block_size = 4, .enable_prefix_caching = false});
    const uint64_t f = *fresh->add_request(greedy(all[i], 4));
    expected[i] = testing::run_to_completion(*fresh)[f].tokens;
  }
  for (size_t i : {3u, 4u, 3u, 4u}) {
    const uint64_t id = *e->add_request(greedy(all[i], 4));
    auto done = testing::run_to_completion(*e);
    EXPECT_EQ(done[id].tokens, expected[i]) << "prompt " << i;
  }
  // Each prompt leaves two snapshots (prompt 3: 28 and 32; prompt 4: 36 and 40), which evict the
  // other's: no restore, and no stale one taken.
  const auto& c = e->scheduler().state_snapshots().counters();
  EXPECT_EQ(c.evictions, 6);
  EXPECT_EQ(c.restores, 0);
  EXPECT_EQ(e->scheduler().state_snapshots().size(), 2);
}

// Hybrid prefix caching with several requests at once, chunked prefill beside decoding and a
// shared prompt: every request still generates what it generates alone.
TEST_F(KimiLinearEngineTest, SharedPrefixesInABatchGenerateWhatEachGeneratesAlone) {
  const auto base = prompts()[4];  // 39 tokens
  std::vector<std::vector<int32_t>> ps;
  for (int i = 0; i < 4; ++i) {
    auto q = base;
    for (int j = 0; j <= i; ++j) q.push_back(100 + 17 * i + j);
    ps.push_back(q);
  }
  std::vector<std::vector<int32_t>> alone;
  for (const auto& q : ps) {
    auto fresh = engine({.block_size = 4, .enable_prefix_caching = false});
    const uint64_t f = *fresh->add_request(greedy(q, 6));
    alone.push_back(testing::run_to_completion(*fresh)[f].tokens);
  }
  auto e = engine({.block_size = 4, .max_num_batched_tokens = 12});
  const uint64_t warm = *e->add_request(greedy(base, 2));
  testing::run_to_completion(*e);
  (void)warm;
  std::vector<uint64_t> ids;
  for (const auto& q : ps) ids.push_back(*e->add_request(greedy(q, 6)));
  auto done = testing::run_to_completion(*e);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "request " << i;
    EXPECT_GT(done[ids[i]].last.cached_tokens, 0) << "request " << i;
  }
}

// Speculative decoding over a hybrid: verification runs k + 1 tokens through the KDA layers, and
// a rejected guess puts the request's state back at the accepted position (rewind_state). A
// proposer wrong at every position in turn, and n-gram lookup, must leave greedy output unchanged.

TEST_F(KimiLinearEngineTest, SpeculativeDecodingRewindsTheStateOfRejectedGuesses) {
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts()) {
    auto e = engine({});
    ASSERT_TRUE(e->add_request(greedy(p, 16)).ok());
    alone.push_back(testing::run_to_completion(*e).begin()->second.tokens);
  }
  for (int32_t k : {1, 3, 6}) {
    auto e = engine({.max_num_batched_tokens = 16});
    std::vector<uint64_t> ids;
    std::map<uint64_t, std::vector<int32_t>> truth;
    for (size_t i = 0; i < alone.size(); ++i) {
      ids.push_back(*e->add_request(greedy(prompts()[i], 16)));
      truth[ids.back()] = alone[i];
    }
    e->set_proposer(std::make_unique<testing::WrongInTurnProposer>(truth, static_cast<int32_t>(model_->config().vocab_size)), k);
    auto done = testing::run_to_completion(*e);
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "k " << k << " request " << i;
    EXPECT_GT(e->stats().accepted_tokens, 0);
    EXPECT_LT(e->stats().accepted_tokens, e->stats().draft_tokens) << "the script must have wrong guesses";
  }
  // n-gram lookup through the engine's own configuration
  EngineConfig c;
  c.speculative.method = "ngram";
  c.speculative.num_tokens = 4;
  c.speculative.ngram_min = 1;
  auto e = engine(c);
  std::vector<uint64_t> ids;
  for (const auto& p : prompts()) ids.push_back(*e->add_request(greedy(p, 16)));
  auto done = testing::run_to_completion(*e);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "ngram request " << i;

}

// Checks a stateful draft (tiny_k3, same vocabulary) against itself started over: before each
// proposal of the live proposer (which rewinds its per-request state to the position the target
// accepted), a fresh proposer with no history drafts for the same requests; their guesses must
// agree. Without the rewind the live draft guesses from a state that has seen rejected tokens.
class FreshComparingProposer final : public Proposer {
 public:
  FreshComparingProposer(DeepseekModel& draft, int64_t vocab) : draft_(draft), vocab_(vocab) {
    live_ = std::move(DraftModelProposer::create(draft, vocab, 8, 128, 4)).value();
  }
  std::string_view name() const override { return "draft-vs-fresh"; }
  void propose(std::span<const ProposeRequest> requests) override {
    auto fresh = std::move(DraftModelProposer::create(draft_, vocab_, 8, 128, 4)).value();
    fresh->propose(requests);
    std::vector<std::vector<int32_t>> expected;
    for (const ProposeRequest& pr : requests) expected.push_back(std::move(pr.request->spec_tokens));
    for (const ProposeRequest& pr : requests) pr.request->spec_tokens.clear();
    live_->propose(requests);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(requests[i].request->spec_tokens, expected[i]) << "request " << requests[i].request->id;
      compared_ += static_cast<int64_t>(expected[i].size());
    }
  }
  void release(uint64_t id) override { live_->release(id); }
  int64_t compared_ = 0;

 private:
  DeepseekModel& draft_;
  int64_t vocab_;
  std::unique_ptr<DraftModelProposer> live_;
};

TEST_F(KimiLinearEngineTest, StatefulDraftRewindsItsOwnStateToTheAcceptedPosition) {
  auto draft = DeepseekModel::load(std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_k3",
                                   {.backend = ops::Backend::cpu, .max_context = 256, .exact_activations = true,
                                    .kv_dtype = DType::F32, .threads = 1});
  ASSERT_TRUE(draft.ok()) << draft.error().message;
  ASSERT_GT((*draft)->state_bytes_per_request(), 0);
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts()) {
    auto e = engine({});
    ASSERT_TRUE(e->add_request(greedy(p, 16)).ok());
    alone.push_back(testing::run_to_completion(*e).begin()->second.tokens);
  }
  auto e = engine({});
  auto checker = std::make_unique<FreshComparingProposer>(**draft, model_->config().vocab_size);
  FreshComparingProposer* check = checker.get();
  e->set_proposer(std::move(checker), 3);
  std::vector<uint64_t> ids;
  for (const auto& p : prompts()) ids.push_back(*e->add_request(greedy(p, 16)));
  auto done = testing::run_to_completion(*e);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << "request " << i;
  EXPECT_GT(check->compared_, 20);
  EXPECT_GT(e->stats().accepted_tokens, 0);
  EXPECT_LT(e->stats().accepted_tokens, e->stats().draft_tokens) << "no guess was rejected: nothing was rewound";
}

}  // namespace
}  // namespace moat
