// DeepSeek-V3's multi-token prediction head as the proposer (--speculative mtp, checkpoints with
// num_nextn_predict_layers > 0): no second model, the checkpoint's own MTP layer (loaded as a
// one-layer DeepseekModel with Options::mtp) reads the target's final hidden state h_p and the
// next token x_{p+1} and predicts x_{p+2}. Chained guesses feed its own output state back with
// the guess before (one MTP layer used k times, as vLLM and sglang run it).
//
// Its latent cache rows sit at the target's positions in blocks of the same ids (a cache of its
// own, as many blocks as the target's plus scratch), so the target's block tables, prefix-cache
// hits, preemption and rollback hold for it unchanged: every target step writes the MTP rows of
// every row it computed and kept (observe_target_step), and chained guesses write past the
// request's computed rows, into its own last block or scratch blocks, which later steps overwrite.
#pragma once

#include <unordered_map>

#include "kv/latent_cache.h"
#include "models/deepseek_v3.h"
#include "spec/guess_sampler.h"
#include "spec/proposer.h"

namespace moat {

class MtpProposer final : public Proposer {
 public:
  // mtp: the checkpoint's MTP layer (DeepseekModel::Options::mtp); target_blocks / block_size:
  // the target's paged cache; max_num_seqs, max_guesses: the engine's limits (scratch blocks).
  static Result<std::unique_ptr<MtpProposer>> create(DeepseekModel& mtp, int64_t target_vocab, int64_t target_hidden,
                                                     int32_t target_blocks, int32_t block_size, int32_t max_num_seqs,
                                                     int32_t max_guesses);
  std::string_view name() const override { return "mtp"; }
  bool wants_target_hidden() const override { return true; }
  void observe_target_step(const SchedulerOutput& step, std::span<const float> hidden) override;
  void propose(std::span<const ProposeRequest> requests) override;
  void release(uint64_t request_id) override { first_.erase(request_id); }

 private:
  MtpProposer(DeepseekModel& mtp, int32_t target_blocks, int32_t block_size, int32_t scratch_per_seq, int32_t max_num_seqs);
  // The first guess's inputs, left by observe_target_step for each decoding request.
  struct First {
    int64_t position = 0;       // n - 1: the row of the target's last computed token
    std::vector<float> logits;  // [vocab] MTP logits there (predict x_{n+1})
    std::vector<float> state;   // [hidden] MTP output state there (the next guess's h)
  };

  DeepseekModel& mtp_;
  int32_t target_blocks_, scratch_per_seq_;
  PagedLatentCache cache_;
  GuessSampler guesses_;
  std::unordered_map<uint64_t, First> first_;
  std::vector<float> prev_, state_, logits_;
  std::vector<int32_t> table_;
};

}  // namespace moat
