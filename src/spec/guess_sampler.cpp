#include "spec/guess_sampler.h"

namespace moat {

void GuessSampler::begin(std::span<Request* const> active) {
  active_.assign(active.begin(), active.end());
  history_.resize(active_.size());
  for (size_t i = 0; i < active_.size(); ++i) history_[i].assign(active_[i]->output.begin(), active_[i]->output.end());
}

void GuessSampler::draw(float* logits, int64_t rows, int64_t vocab) {
  rows_.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    Request& r = *active_[i];
    rows_[i] = {&r.sampling, &r.rng, r.prompt, history_[i]};
  }
  probs_.resize(static_cast<size_t>(rows * vocab));
  sampler_.probabilities(logits, rows, vocab, rows_, probs_.data());
  u_.resize(static_cast<size_t>(rows));
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  // greedy rows are one-hot: any u picks the argmax, and their generators are left alone
  for (int64_t i = 0; i < rows; ++i) u_[i] = active_[i]->sampling.greedy() ? 0.0f : uniform(active_[i]->rng);
  tokens_.resize(static_cast<size_t>(rows));
  ops_->sample_from_probs(probs_.data(), rows, vocab, u_.data(), tokens_.data());
  for (int64_t i = 0; i < rows; ++i) {
    Request& r = *active_[i];
    r.spec_tokens.push_back(tokens_[i]);
    history_[i].push_back(tokens_[i]);
    if (!r.sampling.greedy())
      r.spec_probs.insert(r.spec_probs.end(), probs_.begin() + i * vocab, probs_.begin() + (i + 1) * vocab);
  }
}

}  // namespace moat
