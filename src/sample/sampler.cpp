#include "sample/sampler.h"

#include <cmath>

namespace moat {

Status SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f)
    return make_error("temperature must be >= 0, got {}", temperature);
  if (!(top_p > 0.0f && top_p <= 1.0f)) return make_error("top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return make_error("min_p must be in [0, 1], got {}", min_p);
  if (top_k < -1) return make_error("top_k must be -1, 0 (disabled) or positive, got {}", top_k);
  return ok_status();
}

void Sampler::probabilities(const float* logits, int64_t vocab, const SamplingParams& params, float* probs) {
  ops_->softmax(logits, 1, vocab, params.temperature, probs);
  if (params.top_k > 0 && params.top_k < vocab) ops_->top_k_renorm_prob(probs, 1, vocab, &params.top_k);
  if (params.top_p < 1.0f) ops_->top_p_renorm_prob(probs, 1, vocab, &params.top_p);
  if (params.min_p > 0.0f) ops_->min_p_renorm_prob(probs, 1, vocab, &params.min_p);
}

int32_t Sampler::sample(const float* logits, int64_t vocab, const SamplingParams& params, std::mt19937_64& rng) {
  int32_t token = 0;
  if (params.greedy()) {
    ops_->argmax(logits, 1, vocab, &token);
    return token;
  }
  probs_.resize(static_cast<size_t>(vocab));
  probabilities(logits, vocab, params, probs_.data());
  const float u = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  ops_->sample_from_probs(probs_.data(), 1, vocab, &u, &token);
  return token;
}

}  // namespace moat
