#include "spec/rejection_sampler.h"

#include "base/check.h"

namespace moat {

Verification verify_proposal(const ops::OpTable& ops, float* target_probs, std::span<const float> draft_probs,
                             std::span<const int32_t> drafts, int64_t vocab, std::mt19937_64& rng) {
  const int64_t k = static_cast<int64_t>(drafts.size());
  MOAT_CHECK(draft_probs.empty() || static_cast<int64_t>(draft_probs.size()) == k * vocab,
             "draft probabilities for {} of {} tokens", draft_probs.size() / std::max<int64_t>(1, vocab), k);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  Verification v;
  float* row = target_probs + k * vocab;  // where the emitted token is drawn from
  for (int64_t i = 0; i < k; ++i) {
    const int32_t x = drafts[i];
    MOAT_CHECK(x >= 0 && x < vocab, "draft token {} outside the vocabulary of {}", x, vocab);
    float* p = target_probs + i * vocab;
    const float* q = draft_probs.empty() ? nullptr : draft_probs.data() + i * vocab;
    const float qx = q ? q[x] : 1.0f;
    MOAT_CHECK(qx > 0.0f, "draft token {} has probability 0 under the distribution it was drawn from", x);
    // accept when u < p(x) / q(x), compared without the division
    if (uniform(rng) * qx < p[x]) {
      ++v.accepted;
      continue;
    }
    // Residual max(0, p - q); sample_from_probs renormalizes. It has mass whenever x was
    // rejected (p(x) < q(x) leaves some token with p > q); rounding can leave none, and then p
    // itself is the fair fallback.
    double mass = 0.0;
    if (q) {
      for (int64_t t = 0; t < vocab; ++t) {
        p[t] = std::max(0.0f, p[t] - q[t]);
        mass += p[t];
      }
    } else {
      p[x] = 0.0f;
      for (int64_t t = 0; t < vocab; ++t) mass += p[t];
    }
    if (!(mass > 0.0)) {
      p[x] = 1.0f;  // cannot happen with exact arithmetic: emit the draft token itself
    }
    row = p;
    break;
  }
  const float u = uniform(rng);
  ops.sample_from_probs(row, 1, vocab, &u, &v.token);
  return v;
}

}  // namespace moat
