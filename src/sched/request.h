// A request as the scheduler and the engine core see it: its tokens, its sampling and stop
// settings, and where its latent rows live. The scheduler owns Request objects; everything else
// refers to them by id.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "sample/sampler.h"

namespace moat {

enum class FinishReason { none, stop, length, abort };
inline std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none: return "none";
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
  }
  return "?";
}

struct StopConditions {
  int64_t max_tokens = 16;             // generated tokens, the stop token included
  std::vector<int32_t> eos_token_ids;  // the model's end of sequence; ignored with ignore_eos
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids; // end the request like EOS, even with ignore_eos
  std::vector<std::string> stop_strings;  // matched on the detokenized text (engine core)
  int64_t min_tokens = 0;              // no stop token or string before this many tokens
};

enum class RequestStatus { waiting, running, finished };

struct Request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;          // sampled tokens, a stop token included
  SamplingParams sampling;
  StopConditions stop;
  std::mt19937_64 rng;

  RequestStatus status = RequestStatus::waiting;
  FinishReason finish = FinishReason::none;
  // Tokens whose latent rows are in the cache. The rest, up to length(), are computed by the
  // next steps: prompt chunks, one decode token, or everything again after a preemption.
  int64_t num_computed_tokens = 0;
  int64_t num_cached_tokens = 0;        // prompt tokens found in the prefix cache at admission
  std::vector<int32_t> block_table;     // block ids covering rows [0, blocks * block_size)
  std::vector<uint64_t> block_hashes;   // chain hashes of the full blocks registered so far
  int32_t state_slot = -1;              // recurrent-state slot (kv/state_pool.h) while running; -1: none
  int64_t num_preemptions = 0;
  double arrival_s = 0.0;

  // Speculative decoding (src/spec): tokens a proposer guessed for the positions after length(),
  // verified by the next step that decodes this request; dropped by preemption.
  std::vector<int32_t> spec_tokens;
  // [spec_tokens.size(), vocab] the distributions the draft sampled them from; empty when the
  // proposer is deterministic (n-gram, or a greedy draft): then each is one-hot at its token.
  std::vector<float> spec_probs;
  int64_t num_draft_tokens = 0;     // proposed and verified, over the request's life
  int64_t num_accepted_tokens = 0;  // of those, accepted
  int64_t num_spec_steps = 0;       // verification steps
  // Moving average of the fraction of guesses accepted per verification (adaptive k); < 0
  // before the first.
  double spec_acceptance = -1.0;

  int64_t length() const { return static_cast<int64_t>(prompt.size() + output.size()); }
  int32_t token_at(int64_t i) const {
    const int64_t p = static_cast<int64_t>(prompt.size());
    return i < p ? prompt[i] : output[i - p];
  }
  // token_at, continued past length() into the speculative tokens
  int32_t token_or_spec_at(int64_t i) const {
    const int64_t n = length();
    return i < n ? token_at(i) : spec_tokens[static_cast<size_t>(i - n)];
  }
  bool finished() const { return status == RequestStatus::finished; }
};

}  // namespace moat
