// Token sampling with sglang/flashinfer semantics (DESIGN.md, "Sampling semantics"):
// temperature < 1e-6 is greedy; otherwise softmax(logits / T) -> top-k renorm -> top-p renorm ->
// min-p renorm -> one draw with a uniform from the request's own seeded generator. Every step is a
// registry op, so a backend missing one is caught at load time, not mid-request.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "base/status.h"
#include "ops/dispatch.h"

namespace moat {

struct SamplingParams {
  float temperature = 1.0f;
  int32_t top_k = 0;     // <= 0 or >= vocab: disabled
  float top_p = 1.0f;    // 1: disabled
  float min_p = 0.0f;    // 0: disabled
  uint64_t seed = 0;

  bool greedy() const { return temperature < 1e-6f; }
  // Errors name the parameter: "top_p must be in (0, 1], got 1.5".
  Status validate() const;
};

class Sampler {
 public:
  explicit Sampler(const ops::OpTable& ops) : ops_(&ops) {}

  // logits [vocab] -> token id. rng is the request's generator (seeded from params.seed).
  int32_t sample(const float* logits, int64_t vocab, const SamplingParams& params, std::mt19937_64& rng);
  // The distribution sample() draws from (after temperature and all truncations), for
  // speculative verification and tests. probs: [vocab].
  void probabilities(const float* logits, int64_t vocab, const SamplingParams& params, float* probs);

 private:
  const ops::OpTable* ops_;
  std::vector<float> probs_;
};

}  // namespace moat
