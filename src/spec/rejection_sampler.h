// Acceptance of speculative tokens by rejection sampling (Leviathan et al. 2023, Chen et al.
// 2023), which leaves the target's distribution exactly unchanged: draft token x_i, drawn from
// q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
// emitted token is drawn from the residual max(0, p_i - q_i) (renormalized), and when all k are
// accepted a bonus token is drawn from p_k. p_i are the target's distributions after the
// request's own bias, penalties, temperature, top-k, top-p and min-p (Sampler::probabilities), so
// truncation applies to both sides; a greedy request's p_i is one-hot at the argmax, which makes
// this exact greedy matching. A deterministic proposer (n-gram, a greedy draft) has q_i one-hot
// at x_i: accepted with probability p_i(x_i), the residual is p_i without x_i.
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "ops/dispatch.h"

namespace moat {

struct Verification {
  int32_t accepted = 0;  // draft tokens kept, a prefix of the proposal
  int32_t token = -1;    // the target's own token after them (correction or bonus)
};

// target_probs: [k + 1, vocab], row i the target's distribution for the position of draft token
// i (row k: after all of them); used as scratch for the residual. draft_probs: [k, vocab], or
// empty when every q_i is one-hot at its token. Draws from rng: one uniform per examined draft
// token, one for the emitted token. The final draw is the registry's sample_from_probs op.
Verification verify_proposal(const ops::OpTable& ops, float* target_probs, std::span<const float> draft_probs,
                             std::span<const int32_t> drafts, int64_t vocab, std::mt19937_64& rng);

}  // namespace moat
