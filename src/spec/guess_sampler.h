// Drawing guesses for a proposer that has logits (a draft model, an MTP head): each request's
// guess is sampled with the request's own parameters (bias, penalties over its output and the
// guesses before it, temperature, top-k/p, min-p) from the proposer's logits, and the
// distribution of every non-greedy draw is kept on the request for rejection sampling.
#pragma once

#include <span>
#include <vector>

#include "sample/sampler.h"
#include "sched/request.h"

namespace moat {

class GuessSampler {
 public:
  explicit GuessSampler(const ops::OpTable& ops) : ops_(&ops), sampler_(ops) {}
  // Starts a proposal round for these requests (their proposals empty).
  void begin(std::span<Request* const> active);
  // One guess for each of active[0, rows) from logits [rows, vocab] (modified in place), appended
  // to the request's spec_tokens (and spec_probs unless greedy).
  void draw(float* logits, int64_t rows, int64_t vocab);

 private:
  const ops::OpTable* ops_;
  Sampler sampler_;
  std::vector<Request*> active_;
  std::vector<std::vector<int32_t>> history_;  // [active] output + guesses so far (penalties)
  std::vector<SamplingRow> rows_;
  std::vector<float> probs_, u_;
  std::vector<int32_t> tokens_;
};

}  // namespace moat
