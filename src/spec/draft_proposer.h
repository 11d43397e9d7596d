// A draft model as the proposer: any moat-loadable checkpoint with the target's vocabulary
// (models/k3-nano-draft for models/k3-nano), run in the same process with its own latent cache,
// its own op table and precision. Each step it drafts k tokens for every decoding request in k
// batched forwards: the first catches the draft's cache up with the request (the prompt on first
// sight, then the tokens the target accepted since, and the last token) and drafts one token, the
// other k-1 feed one drafted token each.
//
// The draft samples with the request's own parameters (bias, penalties, temperature, top-k/p,
// min-p) and keeps the distribution of each draw for rejection sampling; greedy requests draft
// greedily, and their one-hot distributions are not stored.
//
// The draft cache keeps rows by position, so a rejection needs no undo: only the rows of tokens
// the target kept (below Request::num_computed_tokens) are trusted at the next proposal. A draft
// with recurrent state (a Kimi Linear / K3-shaped draft) keeps a state slot per request and a
// copy of it after each drafting step; the next proposal restores the copy at the position the
// target accepted (or, with none, starts the request's draft state over).
#pragma once

#include <memory>
#include <unordered_map>

#include "kv/block_pool.h"
#include "kv/latent_cache.h"
#include "models/deepseek_v3.h"
#include "spec/guess_sampler.h"
#include "spec/proposer.h"

namespace moat {

class DraftModelProposer final : public Proposer {
 public:
  // Room for max_num_seqs requests of max_model_len tokens plus the drafted ones; errors when the
  // draft cannot serve the target (vocabulary, context).
  static Result<std::unique_ptr<DraftModelProposer>> create(DeepseekModel& draft, int64_t target_vocab,
                                                            int32_t max_num_seqs, int64_t max_model_len,
                                                            int32_t block_size);
  std::string_view name() const override { return "draft"; }
  void propose(std::span<const ProposeRequest> requests) override;
  void release(uint64_t request_id) override;

  const BlockPool& block_pool() const { return pool_; }

 private:
  DraftModelProposer(DeepseekModel& draft, int32_t num_blocks, int32_t block_size, int32_t max_num_seqs);
  struct State {
    std::vector<int32_t> blocks;
    int64_t valid = 0;  // positions [0, valid) hold the draft's rows of the request's tokens
    int32_t slot = -1;  // recurrent-state slot (stateful drafts), its state after position valid - 1
    // (valid, the slot's bytes) after each drafting step of the last proposal
    std::vector<std::pair<int64_t, std::vector<uint8_t>>> snapshots;
  };
  // Trust the draft's rows and state only below `trusted` (the target's computed tokens).
  void rewind(State& s, int64_t trusted);

  DeepseekModel& model_;
  PagedLatentCache cache_;
  BlockPool pool_;
  GuessSampler guesses_;
  StateSlotPool state_pool_;  // disabled (0 bytes) for drafts without recurrent state
  std::unordered_map<uint64_t, State> states_;
  std::vector<float> logits_;
};

}  // namespace moat
