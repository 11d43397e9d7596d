// The engine core end to end on the shipped k3-nano: continuous batching, chunked prefill, the
// prefix cache, preemption and cancellation must never change what a request generates, and must
// always give every KV block back.
//
// Activations are exact here: the default rounds activations to bf16 in matmuls of more than 16
// tokens, so a decode token batched with a prompt chunk would be computed differently than alone
// (batch variance, as on GPU engines); exact activations make "batched == alone" a fair test of
// the runtime itself.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "engine/engine.h"
#include "run_engine.h"

namespace moat {
namespace {

const std::filesystem::path kModel = std::filesystem::path(MOAT_SOURCE_DIR) / "models/k3-nano";

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = DeepseekModel::load(kModel, {.backend = ops::Backend::cpu, .max_context = 512, .exact_activations = true});
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(m).value().release();
    auto t = Tokenizer::load(kModel);
    ASSERT_TRUE(t.ok()) << t.error().message;
    tokenizer_ = new Tokenizer(std::move(t).value());
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tokenizer_;
  }

  std::unique_ptr<Engine> engine(EngineConfig c = {}) {
    if (c.max_model_len == 0) c.max_model_len = 512;
    if (c.kv_memory_bytes == 0) c.kv_memory_bytes = 64 << 20;
    auto e = Engine::create(*model_, c, tokenizer_);
    EXPECT_TRUE(e.ok()) << e.error().message;
    return std::move(e).value();
  }

  GenerateRequest greedy(const std::string& text, int64_t max_tokens) {
    GenerateRequest r;
    r.prompt = {*tokenizer_->bos_id()};
    for (int32_t id : tokenizer_->encode(text)) r.prompt.push_back(id);
    r.sampling.temperature = 0.0f;
    r.stop.max_tokens = max_tokens;
    r.stop.ignore_eos = true;
    return r;
  }

  using Finished = testing::Finished;
  static std::map<uint64_t, Finished> run(Engine& e) { return testing::run_to_completion(e); }

  const std::vector<std::string> prompts_ = {
      "The meaning of life is", "A computer is",
      "Once upon a time there was a programmer who wrote a scheduler, and the scheduler ran every request",
      "Love is", "Perl is the duct tape of the internet, and"};

  static DeepseekModel* model_;
  static Tokenizer* tokenizer_;
};
DeepseekModel* EngineTest::model_ = nullptr;
Tokenizer* EngineTest::tokenizer_ = nullptr;

TEST_F(EngineTest, BatchedRequestsGenerateWhatEachGeneratesAlone) {
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts_) {
    auto e = engine({.enable_prefix_caching = false});
    ASSERT_TRUE(e->add_request(greedy(p, 12)).ok());
    auto done = run(*e);
    alone.push_back(done.begin()->second.tokens);
    ASSERT_EQ(alone.back().size(), 12u);
  }
  // Together, with a budget of 8 tokens per step: the long prompt is prefilled in chunks while
  // the others decode beside it.
  auto e = engine({.max_num_batched_tokens = 8, .enable_prefix_caching = false});
  std::vector<uint64_t> ids;
  for (const auto& p : prompts_) ids.push_back(*e->add_request(greedy(p, 12)));
  auto done = run(*e);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(done[ids[i]].tokens, alone[i]) << prompts_[i];
    EXPECT_EQ(done[ids[i]].last.finish_reason, FinishReason::length);
  }
}

TEST_F(EngineTest, PrefixCacheHitSkipsPrefillAndChangesNothing) {
  auto e = engine({.block_size = 4});
  const std::string prompt = prompts_[2];
  const uint64_t first = *e->add_request(greedy(prompt, 6));
  auto a = run(*e);
  const int64_t computed_once = e->stats().prompt_tokens_computed;
  const uint64_t second = *e->add_request(greedy(prompt, 6));
  auto b = run(*e);
  EXPECT_EQ(a[first].tokens, b[second].tokens);
  const int64_t prompt_len = a[first].last.prompt_tokens;
  // Every full block but the one holding the last prompt token comes from the cache.
  EXPECT_EQ(b[second].last.cached_tokens, (prompt_len - 1) / 4 * 4);
  EXPECT_EQ(e->stats().prompt_tokens_computed - computed_once, prompt_len - b[second].last.cached_tokens);
  EXPECT_GT(e->scheduler().block_pool().counters().hits, 0);
}

TEST_F(EngineTest, RunningRequestsShareTheirCommonPrefixBlocks) {
  auto e = engine({.block_size = 4});
  const uint64_t a = *e->add_request(greedy(prompts_[2], 20));
  e->step();  // a's prompt is computed and its full blocks registered
  const uint64_t b = *e->add_request(greedy(prompts_[2] + " to the end", 20));
  e->step();
  const Request* ra = e->scheduler().find(a);
  const Request* rb = e->scheduler().find(b);
  ASSERT_TRUE(ra && rb);
  ASSERT_GT(rb->num_cached_tokens, 0);
  EXPECT_EQ(ra->block_table[0], rb->block_table[0]);
  EXPECT_EQ(e->scheduler().block_pool().refcount(ra->block_table[0]), 2);
  run(*e);
}

TEST_F(EngineTest, TinyKvBudgetStillFinishesEveryRequestByPreemption) {
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts_) {
    auto e = engine({.enable_prefix_caching = false});
    ASSERT_TRUE(e->add_request(greedy(p, 24)).ok());
    alone.push_back(run(*e).begin()->second.tokens);
  }
  // Room for 64 tokens of cache at once (8 blocks of 8): far too little for five requests of
  // up to ~50 tokens each.
  const int64_t per_token = model_->cache_shape().bytes_per_token();
  auto e = engine({.block_size = 8, .kv_memory_bytes = 64 * per_token, .max_model_len = 64});
  std::vector<uint64_t> ids;
  for (const auto& p : prompts_) ids.push_back(*e->add_request(greedy(p, 24)));
  auto done = run(*e);
  EXPECT_GT(e->scheduler().num_preemptions(), 0);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, alone[i]) << prompts_[i];
}

TEST_F(EngineTest, AbortMidPrefillAndMidDecodeFreesBlocksAtOnce) {
  auto e = engine({.block_size = 4, .max_num_batched_tokens = 4, .enable_prefix_caching = false});
  const uint64_t decoding = *e->add_request(greedy(prompts_[0], 50));
  for (int i = 0; i < 4; ++i) e->step();  // prompt done, decoding
  const uint64_t prefilling = *e->add_request(greedy(prompts_[2], 50));
  e->step();  // the long prompt is partly computed
  EXPECT_GT(e->scheduler().block_pool().num_used(), 0);
  e->abort(prefilling);
  e->abort(decoding);
  EXPECT_EQ(e->scheduler().block_pool().num_used(), 0);
  auto outs = e->step();
  ASSERT_EQ(outs.size(), 2u);
  for (const auto& o : outs) {
    EXPECT_TRUE(o.finished);
    EXPECT_EQ(o.finish_reason, FinishReason::abort);
  }
  EXPECT_FALSE(e->has_work());
  e->abort(12345);  // unknown ids are ignored
}

TEST_F(EngineTest, StopStringEndsTheTextAndIsNeverStreamed) {
  auto plain = engine();
  ASSERT_TRUE(plain->add_request(greedy(prompts_[0], 30)).ok());
  const std::string full = run(*plain).begin()->second.text;
  // A stop string from the middle of the greedy text (two words, so it spans tokens).
  const size_t at = full.find(' ', full.size() / 3);
  ASSERT_NE(at, std::string::npos) << full;
  const size_t end = full.find(' ', full.find(' ', at + 1) + 1);
  const std::string stop = full.substr(at, end - at);
  ASSERT_GT(stop.size(), 3u) << full;

  auto e = engine();
  auto req = greedy(prompts_[0], 30);
  req.stop.stop_strings = {stop, "never appears in this text"};
  const uint64_t id = *e->add_request(req);
  std::string streamed;
  while (e->has_work())
    for (const auto& out : e->step()) {
      streamed += out.text;
      EXPECT_EQ(streamed.find(stop), std::string::npos) << "the stop string was streamed";
      if (out.finished) {
        EXPECT_EQ(out.id, id);
        EXPECT_EQ(out.finish_reason, FinishReason::stop);
        EXPECT_EQ(out.stop_string, stop);
      }
    }
  EXPECT_EQ(streamed, full.substr(0, full.find(stop)));
  EXPECT_EQ(e->scheduler().block_pool().num_used(), 0);
}

TEST_F(EngineTest, SeededSamplingIsReproducibleInAnyBatch) {
  auto sampled = [&](const std::string& p) {
    GenerateRequest r = greedy(p, 16);
    r.sampling = {.temperature = 0.9f, .top_p = 0.95f, .seed = 1234};
    return r;
  };
  auto alone = engine();
  ASSERT_TRUE(alone->add_request(sampled(prompts_[3])).ok());
  const auto expected = run(*alone).begin()->second.tokens;
  auto e = engine({.max_num_batched_tokens = 8});
  ASSERT_TRUE(e->add_request(greedy(prompts_[2], 16)).ok());
  const uint64_t id = *e->add_request(sampled(prompts_[3]));
  ASSERT_TRUE(e->add_request(sampled(prompts_[4])).ok());
  EXPECT_EQ(run(*e)[id].tokens, expected);
}

TEST_F(EngineTest, BadRequestsAreRefusedWithTheParameterNamed) {
  auto e = engine();
  auto expect_error = [&](GenerateRequest r, const std::string& needle) {
    auto id = e->add_request(std::move(r));
    ASSERT_FALSE(id.ok()) << needle;
    EXPECT_NE(id.error().message.find(needle), std::string::npos) << id.error().message;
  };
  GenerateRequest r = greedy("hi", 4);
  r.sampling.top_p = 1.5f;
  expect_error(r, "top_p");
  r = greedy("hi", 0);
  expect_error(r, "max_tokens");
  r = greedy("hi", 4);
  r.prompt.push_back(1 << 30);
  expect_error(r, "outside the vocabulary");
  r = greedy("hi", 600);
  expect_error(r, "exceeds the context of 512");
  r = greedy("hi", 4);
  r.stop.stop_strings = {""};
  expect_error(r, "stop");
  EXPECT_FALSE(e->has_work());
}

TEST_F(EngineTest, KvMemoryTooSmallForOneContextIsRefusedAtCreation) {
  auto e = Engine::create(*model_, {.kv_memory_bytes = 1000, .max_model_len = 512}, tokenizer_);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("cannot hold one context of 512 tokens"), std::string::npos) << e.error().message;
  auto huge = Engine::create(*model_, {.kv_memory_bytes = int64_t{1} << 50, .max_model_len = 512}, tokenizer_);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().message.find("available"), std::string::npos) << huge.error().message;
}

}  // namespace
}  // namespace moat
