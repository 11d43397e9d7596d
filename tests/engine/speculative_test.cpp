// Speculative decoding end to end on the shipped pair (models/k3-nano and its draft): for every
// proposer, greedy output must be token for token what decoding without speculation gives, alone
// and in a batch, whatever position of a guess is wrong; rejected guesses' KV rows and blocks must
// go back; stop tokens and max_tokens inside an accepted guess must end the request exactly there.
// Activations are exact for the reason engine_test.cpp gives (a verification step multiplies
// 1 + k rows at once; without exact activations that is batch variance, not a runtime bug).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "engine/engine.h"
#include "run_engine.h"
#include "spec/draft_proposer.h"
#include "spec/ngram_proposer.h"

namespace moat {
namespace {

const std::filesystem::path kModels = std::filesystem::path(MOAT_SOURCE_DIR) / "models";

class SpeculativeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = DeepseekModel::load(kModels / "k3-nano", {.backend = ops::Backend::cpu, .max_context = 512, .exact_activations = true});
    ASSERT_TRUE(m.ok()) << m.error().message;
    target_ = std::move(m).value().release();
    auto d = DeepseekModel::load(kModels / "k3-nano-draft",
                                 {.backend = ops::Backend::cpu, .max_context = 512, .exact_activations = true});
    ASSERT_TRUE(d.ok()) << d.error().message;
    draft_ = std::move(d).value().release();
    auto t = Tokenizer::load(kModels / "k3-nano");
    ASSERT_TRUE(t.ok()) << t.error().message;
    tokenizer_ = new Tokenizer(std::move(t).value());
  }
  static void TearDownTestSuite() {
    delete target_;
    delete draft_;
    delete tokenizer_;
  }

  static std::unique_ptr<Engine> engine(EngineConfig c = {}) {
    if (c.max_model_len == 0) c.max_model_len = 512;
    if (c.kv_memory_bytes == 0) c.kv_memory_bytes = 64 << 20;
    if (c.speculative.method == "draft") c.speculative.draft_model = draft_;
    auto e = Engine::create(*target_, c, tokenizer_);
    EXPECT_TRUE(e.ok()) << e.error().message;
    return std::move(e).value();
  }

  static GenerateRequest request(const std::string& text, int64_t max_tokens, float temperature = 0.0f) {
    GenerateRequest r;
    r.prompt = {*tokenizer_->bos_id()};
    for (int32_t id : tokenizer_->encode(text)) r.prompt.push_back(id);
    r.sampling.temperature = temperature;
    r.stop.max_tokens = max_tokens;
    r.stop.ignore_eos = true;
    return r;
  }

  using Finished = testing::Finished;
  static std::map<uint64_t, Finished> run(Engine& e) { return testing::run_to_completion(e); }

  // What plain decoding generates for each request, by prompt.
  static std::vector<Finished> plain(const std::vector<GenerateRequest>& requests) {
    std::vector<Finished> out;
    for (const GenerateRequest& r : requests) {
      auto e = engine();
      EXPECT_TRUE(e->add_request(r).ok());
      out.push_back(run(*e).begin()->second);
    }
    return out;
  }

  const std::vector<std::string> prompts_ = {
      "The meaning of life is", "A computer is",
      "Once upon a time there was a programmer who wrote a scheduler, and the scheduler ran every request",
      "Love is", "Perl is the duct tape of the internet, and the internet is the duct tape of"};

  static DeepseekModel* target_;
  static DeepseekModel* draft_;
  static Tokenizer* tokenizer_;
};
DeepseekModel* SpeculativeTest::target_ = nullptr;
DeepseekModel* SpeculativeTest::draft_ = nullptr;
Tokenizer* SpeculativeTest::tokenizer_ = nullptr;

// Proposes the true greedy continuation (known from a plain run) with one wrong token at a
// position that moves through 0..k-1 and past the end (no wrong token) from one step to the next.
class ScriptedProposer final : public Proposer {
 public:
  ScriptedProposer(std::map<uint64_t, std::vector<int32_t>> truth, int32_t vocab) : truth_(std::move(truth)), vocab_(vocab) {}
  std::string_view name() const override { return "scripted"; }
  void propose(std::span<const ProposeRequest> requests) override {
    for (const ProposeRequest& pr : requests) {
      Request& r = *pr.request;
      const std::vector<int32_t>& t = truth_.at(r.id);
      const size_t from = r.output.size();
      const int32_t wrong_at = calls_++ % (pr.max_tokens + 1);
      for (int32_t j = 0; j < pr.max_tokens && from + j < t.size(); ++j)
        r.spec_tokens.push_back(j == wrong_at ? (t[from + j] + 1) % vocab_ : t[from + j]);
    }
  }
  void release(uint64_t id) override { released_.push_back(id); }
  std::vector<uint64_t> released_;

 private:
  std::map<uint64_t, std::vector<int32_t>> truth_;
  int32_t vocab_;
  int32_t calls_ = 0;
};

TEST_F(SpeculativeTest, EveryProposerKeepsGreedyOutputUnchangedAloneAndBatched) {
  std::vector<GenerateRequest> requests;
  for (const auto& p : prompts_) requests.push_back(request(p, 24));
  const std::vector<Finished> expected = plain(requests);
  for (const std::string method : {"ngram", "draft"}) {
    for (int32_t k : {1, 3, 7}) {
      SCOPED_TRACE(method + " k=" + std::to_string(k));
      // alone
      for (size_t i = 0; i < requests.size(); ++i) {
        auto e = engine({.speculative = {.method = method, .num_tokens = k}});
        ASSERT_TRUE(e->add_request(requests[i]).ok());
        EXPECT_EQ(run(*e).begin()->second.tokens, expected[i].tokens) << prompts_[i];
      }
      // batched, with a budget that chunks the long prompt next to verifications
      auto e = engine({.max_num_batched_tokens = 16, .speculative = {.method = method, .num_tokens = k}});
      std::vector<uint64_t> ids;
      for (const auto& r : requests) ids.push_back(*e->add_request(r));
      auto done = run(*e);
      for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, expected[i].tokens) << prompts_[i];
      EXPECT_GT(e->stats().draft_tokens, 0);
      if (method == "draft") {
        // the shipped draft agrees with the target on ~60% of held-out positions
        EXPECT_GT(e->stats().acceptance_rate(), 0.25) << e->stats().accepted_tokens << "/" << e->stats().draft_tokens;
        auto* dp = dynamic_cast<const DraftModelProposer*>(e->proposer());
        ASSERT_NE(dp, nullptr);
        EXPECT_EQ(dp->block_pool().num_used(), 0) << "draft cache blocks of finished requests not released";
      }
    }
  }
}

TEST_F(SpeculativeTest, RejectionAtEveryPositionRollsBackAndChangesNothing) {
  std::vector<GenerateRequest> requests;
  for (const auto& p : prompts_) requests.push_back(request(p, 30));
  const std::vector<Finished> expected = plain(requests);
  for (int32_t k : {1, 4, 8}) {
    SCOPED_TRACE("k=" + std::to_string(k));
    auto e = engine({.block_size = 4, .max_num_batched_tokens = 64});
    std::map<uint64_t, std::vector<int32_t>> truth;
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < requests.size(); ++i) {
      ids.push_back(*e->add_request(requests[i]));
      truth[ids.back()] = expected[i].tokens;
    }
    auto scripted = std::make_unique<ScriptedProposer>(truth, static_cast<int32_t>(target_->config().vocab_size));
    ScriptedProposer* sp = scripted.get();
    e->set_proposer(std::move(scripted), k);
    auto done = run(*e);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(done[ids[i]].tokens, expected[i].tokens) << prompts_[i];
      EXPECT_EQ(done[ids[i]].text, expected[i].text) << prompts_[i];
    }
    EXPECT_GT(e->stats().accepted_tokens, 0);
    EXPECT_LT(e->stats().accepted_tokens, e->stats().draft_tokens) << "the script must have wrong guesses";
    EXPECT_EQ(sp->released_.size(), ids.size()) << "the proposer hears of every finished request";
  }
}

TEST_F(SpeculativeTest, StopTokenAndMaxTokensInsideAnAcceptedGuessEndTheRequestThere) {
  const GenerateRequest base = request(prompts_[0], 30);
  const Finished full = plain({base})[0];
  ASSERT_GE(full.tokens.size(), 12u);
  // a stop token that greedy decoding reaches at output position 9
  GenerateRequest with_stop = base;
  with_stop.stop.stop_token_ids = {full.tokens[9]};
  const Finished stopped = plain({with_stop})[0];
  GenerateRequest short_max = base;
  short_max.stop.max_tokens = 11;
  for (int32_t k : {4, 8}) {
    auto e = engine();
    const uint64_t a = *e->add_request(with_stop);
    const uint64_t b = *e->add_request(short_max);
    std::map<uint64_t, std::vector<int32_t>> truth{{a, full.tokens}, {b, full.tokens}};
    // guesses run past the stop token: the script proposes the 30-token continuation
    e->set_proposer(std::make_unique<ScriptedProposer>(truth, static_cast<int32_t>(target_->config().vocab_size)), k);
    auto done = run(*e);
    EXPECT_EQ(done[a].tokens, stopped.tokens);
    EXPECT_EQ(done[a].last.finish_reason, FinishReason::stop);
    EXPECT_EQ(done[a].text, stopped.text) << "the stop token has no text";
    EXPECT_EQ(done[b].tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + 11));
    EXPECT_EQ(done[b].last.finish_reason, FinishReason::length);
  }
}

TEST_F(SpeculativeTest, LogprobsOfAcceptedTokensAreTheTargets) {
  GenerateRequest r = request(prompts_[4], 20);
  r.sampling.logprobs = true;
  r.sampling.top_logprobs = 3;
  const Finished expected = plain({r})[0];
  ASSERT_EQ(expected.logprobs.size(), expected.tokens.size());
  auto e = engine({.speculative = {.method = "draft", .num_tokens = 5}});
  const uint64_t id = *e->add_request(r);
  const Finished got = run(*e)[id];
  ASSERT_EQ(got.tokens, expected.tokens);
  ASSERT_EQ(got.logprobs.size(), expected.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_NEAR(got.logprobs[i], expected.logprobs[i], 1e-4) << i;
  EXPECT_GT(e->stats().accepted_tokens, 0);
}

TEST_F(SpeculativeTest, TinyKvBudgetPreemptsAndStillGeneratesTheSame) {
  std::vector<GenerateRequest> requests;
  for (const auto& p : prompts_) requests.push_back(request(p, 24));
  const std::vector<Finished> expected = plain(requests);
  const int64_t per_token = target_->cache_shape().bytes_per_token();
  auto e = engine({.block_size = 8, .kv_memory_bytes = 64 * per_token, .max_model_len = 64,
                   .speculative = {.method = "draft", .num_tokens = 6}});
  std::vector<uint64_t> ids;
  for (const auto& r : requests) ids.push_back(*e->add_request(r));
  auto done = run(*e);
  EXPECT_GT(e->scheduler().num_preemptions(), 0);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]].tokens, expected[i].tokens) << prompts_[i];
}

TEST_F(SpeculativeTest, SeededSamplingIsReproducibleAndAbortFreesTheDraftCache) {
  GenerateRequest r = request(prompts_[1], 24, 0.8f);
  r.sampling.top_p = 0.9f;
  r.sampling.seed = 42;
  std::vector<int32_t> first;
  for (int run_i = 0; run_i < 2; ++run_i) {
    auto e = engine({.speculative = {.method = "draft", .num_tokens = 4}});
    const uint64_t id = *e->add_request(r);
    auto done = run(*e);
    ASSERT_EQ(done[id].tokens.size(), 24u);
    if (run_i == 0) first = done[id].tokens;
    else EXPECT_EQ(done[id].tokens, first);
  }
  auto e = engine({.speculative = {.method = "draft", .num_tokens = 4}});
  const uint64_t id = *e->add_request(r);
  for (int i = 0; i < 3; ++i) e->step();
  auto* dp = dynamic_cast<const DraftModelProposer*>(e->proposer());
  ASSERT_NE(dp, nullptr);
  EXPECT_GT(dp->block_pool().num_used(), 0);
  e->abort(id);
  e->step();
  EXPECT_EQ(dp->block_pool().num_used(), 0);
  EXPECT_EQ(e->scheduler().block_pool().num_used(), 0);
}

TEST_F(SpeculativeTest, BadSpeculativeSettingsAreRefusedWithTheirNames) {
  auto bad = [](EngineConfig c) {
    c.max_model_len = 512;
    c.kv_memory_bytes = 64 << 20;
    auto e = Engine::create(*target_, c, tokenizer_);
    EXPECT_FALSE(e.ok());
    return e.ok() ? std::string() : e.error().message;
  };
  EXPECT_NE(bad({.speculative = {.method = "eagle"}}).find("unknown method"), std::string::npos);
  EXPECT_NE(bad({.speculative = {.method = "ngram", .num_tokens = 0}}).find("--num-speculative-tokens"), std::string::npos);
  EXPECT_NE(bad({.speculative = {.method = "draft"}}).find("draft model"), std::string::npos);
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

// The MTP proposer on a golden checkpoint that carries an MTP layer (random weights: it guesses
// badly, which exercises rejection; greedy output must not change).
class MtpSpeculativeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto dir = std::filesystem::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_qlora";
    const DeepseekModel::Options o{.backend = ops::Backend::cpu, .max_context = 128, .exact_activations = true};
    auto t = DeepseekModel::load(dir, o);
    ASSERT_TRUE(t.ok()) << t.error().message;
    target_ = std::move(t).value().release();
    DeepseekModel::Options mo = o;
    mo.mtp = true;
    auto h = DeepseekModel::load(dir, mo);
    ASSERT_TRUE(h.ok()) << h.error().message;
    head_ = std::move(h).value().release();
  }
  static void TearDownTestSuite() {
    delete target_;
    delete head_;
  }
  static std::unique_ptr<Engine> engine(EngineConfig c) {
    if (c.max_model_len == 0) c.max_model_len = 128;
    if (c.kv_memory_bytes == 0) c.kv_memory_bytes = 8 << 20;
    if (c.speculative.enabled()) c.speculative.draft_model = head_;
    auto e = Engine::create(*target_, c);
    EXPECT_TRUE(e.ok()) << e.error().message;
    return std::move(e).value();
  }
  static GenerateRequest request(uint32_t seed, int64_t len, int64_t max_tokens) {
    GenerateRequest r;
    std::mt19937 g(seed);
    for (int64_t i = 0; i < len; ++i) r.prompt.push_back(static_cast<int32_t>(2 + g() % 500));
    r.sampling.temperature = 0.0f;
    r.stop.max_tokens = max_tokens;
    r.stop.ignore_eos = true;
    return r;
  }
  static std::map<uint64_t, std::vector<int32_t>> run(Engine& e) {
    std::map<uint64_t, std::vector<int32_t>> out;
    for (int steps = 0; e.has_work(); ++steps) {
      EXPECT_LT(steps, 10000);
      for (const RequestOutput& o : e.step()) out[o.id].insert(out[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
      e.scheduler().check_invariants();
    }
    EXPECT_EQ(e.scheduler().block_pool().num_used(), 0);
    return out;
  }
  static DeepseekModel* target_;
  static DeepseekModel* head_;
};
DeepseekModel* MtpSpeculativeTest::target_ = nullptr;
DeepseekModel* MtpSpeculativeTest::head_ = nullptr;

TEST_F(MtpSpeculativeTest, GreedyOutputUnchangedWithPrefixHitsChunksAndPreemption) {
  std::vector<GenerateRequest> requests;
  for (uint32_t s = 0; s < 5; ++s) requests.push_back(request(s, 10 + 7 * s, 30));
  requests.push_back(requests[4]);  // a whole-prompt prefix hit: its MTP rows come from the cache too
  std::vector<std::vector<int32_t>> expected;
  for (const auto& r : requests) {
    auto e = engine({});
    const uint64_t id = *e->add_request(r);
    expected.push_back(run(*e)[id]);
  }
  for (int32_t k : {1, 3, 6}) {
    SCOPED_TRACE("k=" + std::to_string(k));
    auto e = engine({.block_size = 4, .max_num_batched_tokens = 24, .speculative = {.method = "mtp", .num_tokens = k}});
    std::vector<uint64_t> ids;
    for (const auto& r : requests) ids.push_back(*e->add_request(r));
    auto done = run(*e);
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]], expected[i]) << "request " << i;
    EXPECT_GT(e->stats().draft_tokens, 0);
    EXPECT_GT(e->scheduler().block_pool().counters().hits, 0);
  }
  // far too little KV for all at once: preemption and recomputation under MTP
  const int64_t per_token = target_->cache_shape().bytes_per_token();
  auto e = engine({.block_size = 4, .kv_memory_bytes = 80 * per_token, .max_model_len = 72,
                   .speculative = {.method = "mtp", .num_tokens = 4}});
  std::vector<uint64_t> ids;
  for (const auto& r : requests) ids.push_back(*e->add_request(r));
  auto done = run(*e);
  EXPECT_GT(e->scheduler().num_preemptions(), 0);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(done[ids[i]], expected[i]) << "request " << i;
}

// The proposer's first two guesses after a prompt are the head's argmax computed by hand: the
// target's final hidden states of every prompt position paired with the next token, then the
// head's own state paired with its first guess.
TEST_F(MtpSpeculativeTest, GuessesAreTheHeadsPredictionsFromTheTargetsHiddenStates) {
  const GenerateRequest r = request(9, 12, 10);
  auto e = engine({.speculative = {.method = "mtp", .num_tokens = 2, .min_guess_acceptance = 0}});
  const uint64_t id = *e->add_request(r);
  auto outs = e->step();  // the prompt, the first token, then the proposal
  ASSERT_EQ(outs.size(), 1u);
  const int32_t first = outs[0].new_tokens.at(0);
  const Request* req = e->scheduler().find(id);
  ASSERT_NE(req, nullptr);
  ASSERT_EQ(req->spec_tokens.size(), 2u);

  const int64_t H = target_->config().hidden_size, V = target_->config().vocab_size;
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  SequenceCache tc = target_->new_sequence_cache(n, 4);
  std::vector<float> hidden(static_cast<size_t>(n * H)), logits(static_cast<size_t>(V));
  target_->forward(ForwardBatch::for_sequence(r.prompt, 0, tc.blocks, 4), tc.pages, logits.data(), nullptr,
                   {.final_hidden = hidden.data()});
  std::vector<int32_t> next(r.prompt.begin() + 1, r.prompt.end());
  next.push_back(first);
  SequenceCache mc = head_->new_sequence_cache(n + 1, 4);
  std::vector<float> state(static_cast<size_t>(n * H)), head_logits(static_cast<size_t>(V));
  head_->forward(ForwardBatch::for_sequence(next, 0, mc.blocks, 4), mc.pages, head_logits.data(), nullptr,
                 {.mtp_prev_hidden = hidden.data(), .residual = state.data()});
  const int32_t guess0 = static_cast<int32_t>(std::max_element(head_logits.begin(), head_logits.end()) - head_logits.begin());
  EXPECT_EQ(req->spec_tokens[0], guess0);
  std::vector<float> state1(static_cast<size_t>(H));
  head_->forward(ForwardBatch::for_sequence({&guess0, 1}, static_cast<int32_t>(n), mc.blocks, 4), mc.pages,
                 head_logits.data(), nullptr, {.mtp_prev_hidden = state.data() + (n - 1) * H, .residual = state1.data()});
  const int32_t guess1 = static_cast<int32_t>(std::max_element(head_logits.begin(), head_logits.end()) - head_logits.begin());
  EXPECT_EQ(req->spec_tokens[1], guess1);
  run(*e);
}

}  // namespace
}  // namespace moat
