// The thread-safe front: server threads submit and stream while one engine thread steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "engine/async_engine.h"

namespace moat {
namespace {

const std::filesystem::path kModel = std::filesystem::path(MOAT_SOURCE_DIR) / "models/k3-nano";

struct Loaded {
  std::unique_ptr<DeepseekModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Loaded& loaded() {
  static Loaded l = [] {
    Loaded x;
    auto m = DeepseekModel::load(kModel, {.backend = ops::Backend::cpu, .max_context = 256, .exact_activations = true});
    EXPECT_TRUE(m.ok());
    x.model = std::move(m).value();
    auto t = Tokenizer::load(kModel);
    EXPECT_TRUE(t.ok());
    x.tokenizer = std::make_unique<Tokenizer>(std::move(t).value());
    return x;
  }();
  return l;
}

std::unique_ptr<AsyncEngine> start(AsyncEngine::Options o = {}) {
  auto e = Engine::create(*loaded().model, {.kv_memory_bytes = 32 << 20, .max_model_len = 256}, loaded().tokenizer.get());
  EXPECT_TRUE(e.ok());
  return std::make_unique<AsyncEngine>(std::move(e).value(), o);
}

GenerateRequest request(const std::string& text, int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = loaded().tokenizer->encode(text);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  r.stop.ignore_eos = true;
  return r;
}

// Reads a stream to its end: (tokens, finish reason).
std::pair<std::vector<int32_t>, FinishReason> drain(RequestStream& s) {
  std::vector<int32_t> tokens;
  for (int waited = 0; waited < 600; ++waited) {
    auto out = s.next(std::chrono::milliseconds(100));
    if (!out) continue;
    tokens.insert(tokens.end(), out->new_tokens.begin(), out->new_tokens.end());
    if (out->finished) return {tokens, out->finish_reason};
  }
  ADD_FAILURE() << "stream never finished";
  return {tokens, FinishReason::none};
}

TEST(AsyncEngine, ConcurrentSubmittersEachGetTheirWholeStream) {
  auto e = start();
  std::vector<std::thread> clients;
  std::vector<std::vector<int32_t>> got(6);
  for (int i = 0; i < 6; ++i)
    clients.emplace_back([&, i] {
      auto s = e->submit(request(i % 2 ? "A computer is" : "The meaning of life is", 10));
      ASSERT_TRUE(std::holds_alternative<std::shared_ptr<RequestStream>>(s));
      auto [tokens, reason] = drain(*std::get<0>(s));
      EXPECT_EQ(reason, FinishReason::length);
      got[i] = tokens;
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(got[i].size(), 10u);
    EXPECT_EQ(got[i], got[i % 2]) << "same prompt, greedy: same tokens in any batch";
  }
  e->shutdown(true);
  EXPECT_EQ(e->snapshot().kv_blocks_used, 0);
}

// The server sleeps on one signal for all n choices of a response: every output of every
// stream must ring it, and a reader that saw the count before looking must never sleep through one.
TEST(AsyncEngine, SharedSignalRingsForEveryOutputOfEveryStream) {
  auto e = start();
  auto signal = std::make_shared<StreamSignal>();
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(std::get<0>(e->submit(request("A computer is", 5 + i), signal)));
  int outputs = 0, finished = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (finished < 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "slept through outputs";
    const uint64_t seen = signal->rings();
    bool got = false;
    for (auto& s : streams)
      while (auto out = s->next(std::chrono::milliseconds(0))) {
        got = true;
        ++outputs;
        finished += out->finished;
      }
    // A generous timeout: a missed ring shows up as the deadline, not as a slow pass.
    if (!got && finished < 3) signal->wait(seen, std::chrono::seconds(30));
  }
  EXPECT_GE(signal->rings(), static_cast<uint64_t>(outputs));
  EXPECT_GE(outputs, 3);
  e->shutdown(true);
}

TEST(AsyncEngine, AbortFromAnotherThreadEndsTheStreamAndFreesBlocks) {
  auto e = start();
  auto s = std::get<0>(e->submit(request("The meaning of life is", 200)));
  ASSERT_TRUE(s->next(std::chrono::seconds(60)).has_value());  // it is decoding
  e->abort(s->id());
  auto [tokens, reason] = drain(*s);
  EXPECT_EQ(reason, FinishReason::abort);
  EXPECT_LT(tokens.size(), 200u);
  for (int i = 0; i < 100 && e->snapshot().kv_blocks_used > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(e->snapshot().kv_blocks_used, 0);
  EXPECT_EQ(e->snapshot().running, 0);
}

TEST(AsyncEngine, RefusalsSayWhy) {
  auto e = start({.max_waiting = 0});
  auto full = e->submit(request("hi", 4));
  ASSERT_TRUE(std::holds_alternative<AsyncEngine::Refusal>(full));
  EXPECT_EQ(std::get<1>(full).kind, AsyncEngine::SubmitError::queue_full);
  auto e2 = start();
  GenerateRequest bad = request("hi", 4);
  bad.sampling.temperature = -1;
  auto invalid = e2->submit(bad);
  ASSERT_TRUE(std::holds_alternative<AsyncEngine::Refusal>(invalid));
  EXPECT_EQ(std::get<1>(invalid).kind, AsyncEngine::SubmitError::invalid);
  EXPECT_NE(std::get<1>(invalid).message.find("temperature"), std::string::npos);
  e2->shutdown(true);
  auto late = e2->submit(request("hi", 4));
  ASSERT_TRUE(std::holds_alternative<AsyncEngine::Refusal>(late));
  EXPECT_EQ(std::get<1>(late).kind, AsyncEngine::SubmitError::shutting_down);
}

TEST(AsyncEngine, ShutdownWithoutDrainAbortsInFlightRequests) {
  auto e = start();
  auto s = std::get<0>(e->submit(request("The meaning of life is", 200)));
  e->shutdown(false);
  auto [tokens, reason] = drain(*s);
  EXPECT_EQ(reason, FinishReason::abort);
}

}  // namespace
}  // namespace moat
