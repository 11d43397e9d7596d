// The scheduler alone: plain data in, plain data out, so every policy is tested without a model.
// A "step" here schedules, pretends the model ran, and feeds back one fixed token per sampling
// chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "sched/scheduler.h"

namespace moat {
namespace {

std::unique_ptr<Request> make_request(uint64_t id, int32_t prompt_len, int64_t max_tokens, int32_t first_token = 1) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->prompt.resize(static_cast<size_t>(prompt_len));
  std::iota(r->prompt.begin(), r->prompt.end(), first_token);
  r->stop.max_tokens = max_tokens;
  return r;
}

SchedulerConfig config(int32_t blocks, int32_t block_size, int64_t budget, int32_t max_seqs = 16) {
  SchedulerConfig c;
  c.num_blocks = blocks;
  c.block_size = block_size;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_seqs;
  c.max_model_len = 1024;
  return c;
}

// Runs one step; returns the output it scheduled.
SchedulerOutput step(Scheduler& s, int32_t token = 7) {
  SchedulerOutput out = s.schedule();
  std::vector<int32_t> sampled;
  for (const auto& c : out.chunks)
    if (c.samples()) sampled.push_back(token);
  s.update(out, sampled);
  s.check_invariants();
  return out;
}

TEST(Scheduler, LongPromptIsChunkedAndDecodesGoFirst) {
  Scheduler s(config(64, 4, 8));
  ASSERT_TRUE(s.add(make_request(1, 3, 5)).ok());
  auto out = step(s);  // request 1: whole prompt, samples its first token
  ASSERT_EQ(out.chunks.size(), 1u);
  EXPECT_EQ(out.chunks[0].num_tokens, 3);
  ASSERT_TRUE(s.add(make_request(2, 20, 2)).ok());
  // Budget 8: request 1's decode token first, then 7 tokens of request 2's prompt.
  out = step(s);
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[0].request->id, 1u);
  EXPECT_EQ(out.chunks[0].num_tokens, 1);
  EXPECT_EQ(out.chunks[1].request->id, 2u);
  EXPECT_EQ(out.chunks[1].num_tokens, 7);
  EXPECT_FALSE(out.chunks[1].samples());
  out = step(s);
  EXPECT_EQ(out.chunks[1].first, 7);
  EXPECT_EQ(out.chunks[1].num_tokens, 7);
  out = step(s);  // the last 6 prompt tokens: request 2 samples
  EXPECT_EQ(out.chunks[1].num_tokens, 6);
  EXPECT_TRUE(out.chunks[1].samples());
  EXPECT_EQ(out.num_scheduled_tokens, 7);
}

TEST(Scheduler, EveryRequestFinishesWithATinyPoolByPreemption) {
  // 6 blocks of 4 tokens = 24 rows; each request needs up to 6 + 10 = 16 rows (4 blocks).
  Scheduler s(config(6, 4, 64));
  for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(s.add(make_request(id, 6, 10, static_cast<int32_t>(id) * 100)).ok());
  std::map<uint64_t, size_t> outputs;
  int steps = 0;
  while (s.has_work()) {
    step(s);
    for (auto& done : s.take_finished()) {
      EXPECT_EQ(done->finish, FinishReason::length);
      outputs[done->id] = done->output.size();
    }
    ASSERT_LT(++steps, 1000) << "no progress";
  }
  EXPECT_EQ(outputs.size(), 5u);
  for (auto& [id, n] : outputs) EXPECT_EQ(n, 10u) << id;
  EXPECT_GT(s.num_preemptions(), 0);
  EXPECT_EQ(s.block_pool().num_free(), 6);
}

TEST(Scheduler, ARequestLargerThanThePoolIsRefusedWithNumbers) {
  Scheduler s(config(2, 4, 64));
  auto st = s.add(make_request(1, 6, 10));
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("needs 4 KV blocks"), std::string::npos) << st.error().message;
  auto too_long = s.add(make_request(2, 1000, 100));
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.error().message.find("exceeds the context of 1024"), std::string::npos);
  // A max_tokens near INT64_MAX must not wrap the sum into something that fits.
  auto wraps = s.add(make_request(3, 6, INT64_MAX - 2));
  ASSERT_FALSE(wraps.ok());
  EXPECT_NE(wraps.error().message.find("exceeds the context of 1024"), std::string::npos) << wraps.error().message;
}

TEST(Scheduler, AbortFreesBlocksAtOnceMidPrefillAndMidDecode) {
  Scheduler s(config(32, 4, 8));
  ASSERT_TRUE(s.add(make_request(1, 30, 5)).ok());
  ASSERT_TRUE(s.add(make_request(2, 3, 50)).ok());
  step(s);  // request 1 mid-prefill (8 of 30)
  step(s);
  EXPECT_LT(s.block_pool().num_free(), 32);
  s.finish(1, FinishReason::abort);
  s.check_invariants();
  step(s);
  step(s);  // request 2 decoding by now
  s.finish(2, FinishReason::abort);
  s.check_invariants();
  EXPECT_EQ(s.block_pool().num_free(), 32);
  EXPECT_FALSE(s.has_work());
  auto done = s.take_finished();
  ASSERT_EQ(done.size(), 2u);
  for (auto& r : done) EXPECT_EQ(r->finish, FinishReason::abort);
}

TEST(Scheduler, SharedPromptPrefixIsTakenFromTheCache) {
  Scheduler s(config(32, 4, 64));
  ASSERT_TRUE(s.add(make_request(1, 10, 1)).ok());
  step(s);  // computes 10 rows: blocks 0 and 1 are full and registered
  ASSERT_FALSE(s.has_work());
  s.take_finished();
  // Same first 10 tokens: two full blocks (8 tokens) come from the cache.
  ASSERT_TRUE(s.add(make_request(2, 10, 3)).ok());
  auto out = step(s);
  ASSERT_EQ(out.chunks.size(), 1u);
  EXPECT_EQ(out.chunks[0].first, 8);
  EXPECT_EQ(out.chunks[0].num_tokens, 2);
  EXPECT_EQ(out.chunks[0].request->num_cached_tokens, 8);
  EXPECT_EQ(s.block_pool().counters().hits, 2);
  // A prompt of exactly two blocks: the last token is recomputed, so only one block is a hit.
  ASSERT_TRUE(s.add(make_request(3, 8, 3)).ok());
  out = step(s);
  EXPECT_EQ(out.chunks.back().request->num_cached_tokens, 4);
  // While both run, their first block is one block with two references.
  Request* r2 = s.find(2);
  Request* r3 = s.find(3);
  ASSERT_TRUE(r2 && r3);
  ASSERT_FALSE(r2->finished());
  ASSERT_FALSE(r3->finished()) << r3->output.size();
  EXPECT_EQ(r2->block_table[0], r3->block_table[0]);
  EXPECT_EQ(s.block_pool().refcount(r2->block_table[0]), 2);
}

TEST(Scheduler, StopTokensEndRequestsUnlessIgnoringEos) {
  Scheduler s(config(32, 4, 64));
  auto a = make_request(1, 3, 10);
  a->stop.eos_token_ids = {7};
  auto b = make_request(2, 3, 4);
  b->stop.eos_token_ids = {7};
  b->stop.ignore_eos = true;
  auto c = make_request(3, 3, 10);
  c->stop.stop_token_ids = {7};
  c->stop.min_tokens = 2;
  ASSERT_TRUE(s.add(std::move(a)).ok());
  ASSERT_TRUE(s.add(std::move(b)).ok());
  ASSERT_TRUE(s.add(std::move(c)).ok());
  while (s.has_work()) step(s, 7);
  std::map<uint64_t, std::unique_ptr<Request>> done;
  for (auto& r : s.take_finished()) done[r->id] = std::move(r);
  EXPECT_EQ(done[1]->finish, FinishReason::stop);
  EXPECT_EQ(done[1]->output.size(), 1u);
  EXPECT_EQ(done[2]->finish, FinishReason::length);
  EXPECT_EQ(done[2]->output.size(), 4u);
  EXPECT_EQ(done[3]->finish, FinishReason::stop);
  EXPECT_EQ(done[3]->output.size(), 3u);  // min_tokens 2: the third 7 stops it
}

TEST(Scheduler, MaxNumSeqsBoundsTheRunningSet) {
  Scheduler s(config(64, 4, 64, /*max_seqs=*/2));
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(s.add(make_request(id, 2, 3)).ok());
  step(s);
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 2);
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

SchedulerConfig with_state(SchedulerConfig c, int32_t slots, int64_t bytes = 256) {
  c.state_bytes_per_request = bytes;
  c.num_state_slots = slots;
  return c;
}

// A model with recurrent state (the Kimi K3 hybrid): a running request holds one slot, taken at
// admission and given back when it finishes, is aborted or preempted; requests beyond the slots
// wait; no prefix hits are taken (a prefix's state is not cached).
TEST(Scheduler, StateSlotsBoundAdmissionAndComeBackOnFinishAbortAndPreemption) {
  Scheduler s(with_state(config(64, 4, 64), 2));
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(s.add(make_request(id, 5, 3)).ok());
  auto out = step(s);
  EXPECT_EQ(out.chunks.size(), 2u) << "two slots: two requests run";
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.state_pool().num_free(), 0);
  for (const auto& c : out.chunks) {
    EXPECT_GE(c.request->state_slot, 0);
    const uint8_t* state = s.state_of(*c.request);
    ASSERT_NE(state, nullptr);
    EXPECT_EQ(std::count(state, state + 256, 0), 256) << "a new request's state starts zeroed";
  }
  s.finish(1, FinishReason::abort);
  EXPECT_EQ(s.state_pool().num_free(), 1);
  out = step(s);  // request 3 takes the freed slot
  EXPECT_EQ(s.num_running(), 2);
  while (s.has_work()) step(s);
  EXPECT_EQ(s.state_pool().num_free(), 2);

  // a pool too small for both: the newest is preempted, and its slot goes with its blocks
  Scheduler p(with_state(config(4, 4, 64), 2));
  ASSERT_TRUE(p.add(make_request(10, 6, 8)).ok());
  ASSERT_TRUE(p.add(make_request(11, 6, 8)).ok());
  step(p);
  while (p.has_work()) step(p);
  EXPECT_GT(p.num_preemptions(), 0);
  EXPECT_EQ(p.state_pool().num_free(), 2);
  EXPECT_EQ(p.block_pool().num_used(), 0);

  // no prefix hits with state, even for an identical prompt
  Scheduler c(with_state(config(64, 4, 64), 4));
  ASSERT_TRUE(c.add(make_request(20, 12, 2)).ok());
  while (c.has_work()) step(c);
  ASSERT_TRUE(c.add(make_request(21, 12, 2)).ok());
  step(c);
  EXPECT_EQ(c.find(21)->num_cached_tokens, 0);
  EXPECT_EQ(c.block_pool().counters().hits, 0);
}

TEST(Scheduler, ModelsWithoutStateTakeNoSlots) {
  Scheduler s(config(64, 4, 64));
  EXPECT_FALSE(s.state_pool().enabled());
  ASSERT_TRUE(s.add(make_request(1, 5, 2)).ok());
  auto out = step(s);
  EXPECT_EQ(out.chunks[0].request->state_slot, -1);
  EXPECT_EQ(s.state_of(*out.chunks[0].request), nullptr);
}

}  // namespace
}  // namespace moat
