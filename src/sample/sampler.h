// Token sampling with sglang/flashinfer semantics (DESIGN.md, "Sampling semantics") and the
// OpenAI / vLLM request parameters. The engine calls Sampler::sample once per step with one logits
// row per running request, each row with its own parameters. Per row, in this order:
//
//   1. logit_bias:  logits[id] += bias                                   (OpenAI logit_bias)
//   2. penalties (vLLM's apply_penalties, in its order):
//        repetition: each distinct token of prompt + output: l > 0 ? l / r : l * r    (HF / vLLM)
//        frequency, presence: each distinct output token seen c times: l -= f * c + p
//   3. logprobs (rows that ask): log_softmax of the logits as they are now
//   4. greedy (temperature < 1e-6): argmax, lowest id on ties
//      else softmax(logits / T) -> top-k renorm -> top-p renorm -> min-p renorm -> one draw with
//      one uniform from the row's own generator
//
// Logprobs are taken after bias and penalties and before temperature and truncation. That is not
// vLLM's default (raw_logprobs: the model's logits before any processing), nor its
// "processed_logprobs" (after temperature and top-k/top-p too); it is what OpenAI reports: the
// probabilities the request's own bias and penalties give, the same at any temperature, finite for
// every token (so a greedy row, or a candidate that top-k cut, still has a real logprob to show).
//
// Every step over the vocabulary (softmax, the renorms, the draw, argmax) is a registry op called
// through the OpTable, so a backend missing one is caught at load time; each renorm op is called
// once per step for all rows that sample, a row without that truncation passing its "off" value
// (k = 0, p = 1, min_p = 0: the op only renormalizes it). Bias, penalties and logprob selection
// are plain loops on the host row: bias and penalties cost O(bias entries + tokens seen) per row,
// never O(vocab). Logits are host memory (the cpu and reference backends).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "base/status.h"
#include "ops/dispatch.h"

namespace moat {

struct SamplingParams {
  float temperature = 1.0f;  // < 1e-6: greedy
  int32_t top_k = 0;         // <= 0 or >= vocab: disabled
  float top_p = 1.0f;        // 1: disabled
  float min_p = 0.0f;        // 0: disabled
  // Unset: the engine draws one per request (OpenAI / vLLM). Set: the same request with the same
  // seed gives the same tokens, whatever else shares its batch.
  std::optional<uint64_t> seed;
  float presence_penalty = 0.0f;    // [-2, 2]; output tokens only
  float frequency_penalty = 0.0f;   // [-2, 2]; output tokens only
  float repetition_penalty = 1.0f;  // > 0, 1: off; prompt and output tokens
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100]), ids distinct
  bool logprobs = false;       // the chosen token's logprob
  int32_t top_logprobs = 0;    // [0, 20] most likely tokens per step, with their logprobs

  bool greedy() const { return temperature < 1e-6f; }
  bool wants_logprobs() const { return logprobs || top_logprobs > 0; }
  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
  // Errors name the parameter and the allowed range: "top_p must be in (0, 1], got 1.5",
  // "logit_bias: token id 70000 outside the vocabulary of 32000". vocab_size = 0 (not known yet)
  // checks ids only for >= 0; the engine passes its model's vocabulary.
  Status validate(int64_t vocab_size = 0) const;
};

// One row of a step's batch. Plain views; the engine owns everything they point to.
struct SamplingRow {
  const SamplingParams* params = nullptr;
  std::mt19937_64* rng = nullptr;          // the request's generator; unused by greedy rows
  std::span<const int32_t> prompt_tokens;  // repetition_penalty
  std::span<const int32_t> output_tokens;  // all three penalties
};

struct SampledToken {
  int32_t token = -1;
  float logprob = NAN;  // of `token`, when params->wants_logprobs()
  // params->top_logprobs entries, most likely first (lower id first on ties)
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

class Sampler {
 public:
  explicit Sampler(const ops::OpTable& ops) : ops_(&ops) {}

  // The engine's call, once per step. logits: [R, vocab], bias and penalties applied in place.
  // rows, out: [R].
  void sample(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
              std::span<SampledToken> out);
  // The distributions sample() draws from (after bias, penalties, temperature and every
  // truncation; one-hot at the argmax for greedy rows), for speculative verification.
  // logits: [R, vocab], modified in place as by sample(); probs: [R, vocab].
  void probabilities(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows, float* probs);

  // Logprobs of chosen tokens: logits [R, vocab] after bias and penalties (as probabilities()
  // leaves them); fills out[r].token = tokens[r], its logprob and top_logprobs, for rows that ask.
  void logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                std::span<const int32_t> tokens, std::span<SampledToken> out);

  // One row, no token history (so no penalties): logits [vocab] -> token id. rng is the request's.
  int32_t sample(const float* logits, int64_t vocab, const SamplingParams& params, std::mt19937_64& rng);
  // probs: [vocab], the distribution the one-row sample() draws from.
  void probabilities(const float* logits, int64_t vocab, const SamplingParams& params, float* probs);

 private:
  // Steps 1-2 on rows [R, vocab].
  void apply_bias_and_penalties(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows);
  // Step 3 for the rows that ask.
  void fill_logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                     std::span<SampledToken> out);
  // out[r].logprob of out[r].token, from the max and log-sum fill_logprobs left (rows that ask).
  void chosen_logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                       std::span<SampledToken> out) const;
  // Step 4's distributions for rows `which` (indices into rows), into probs [which.size(), vocab].
  void distributions(const float* logits, int64_t vocab, std::span<const SamplingRow> rows,
                     std::span<const int64_t> which, float* probs);
  // A logits row the one-row calls may write into: `logits` itself when nothing will be written.
  float* writable_row(const float* logits, int64_t vocab, const SamplingParams& params);

  const ops::OpTable* ops_;
  std::vector<float> probs_;         // [sampling rows, vocab]
  std::vector<float> row_;           // [vocab] softmax scratch for logprobs
  std::vector<float> one_row_;       // [vocab] the one-row calls' copy of a row they bias
  // [R] per logprob row: max of the processed logits, log(sum(exp(logits - max)))
  std::vector<float> row_max_, log_sum_;
  std::vector<int32_t> top_;         // top_logprobs candidates of one row
  std::vector<uint32_t> seen_;       // [vocab] step stamp of the last time a token was penalized
  std::vector<int32_t> counts_;      // [vocab] output-token counts, zero between rows
  uint32_t stamp_ = 0;
  std::vector<int64_t> which_;
  std::vector<int32_t> k_, tokens_;
  std::vector<float> p_, min_p_, u_;
};

}  // namespace moat
