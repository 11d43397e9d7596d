// Single-request generation: chunked prefill over the latent cache, then one decode step per
// token. `moat generate` and the model benchmarks use it; the server's batching engine is built
// on the same model forward.
#pragma once

#include <functional>
#include <vector>

#include "models/deepseek_v3.h"
#include "sample/sampler.h"

namespace moat {

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_seconds = 0.0;  // up to and including the first sampled token
  double decode_seconds = 0.0;   // the remaining tokens
  bool stopped_on_eos = false;

  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0; }
  // Tokens after the first over the time they took (the first comes out of prefill).
  double decode_tokens_per_second() const {
    return decode_seconds > 0 && generated_tokens > 1 ? (generated_tokens - 1) / decode_seconds : 0.0;
  }
};

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;  // e.g. eos; not emitted
  bool ignore_eos = false;
  int64_t prefill_chunk = 512;          // tokens per prefill forward
};

class Generator {
 public:
  explicit Generator(DeepseekModel& model) : model_(model), sampler_(model.ops()) {}

  // on_token(id) is called for each generated token as soon as it is sampled; returning false stops.
  Result<GenerationStats> generate(const std::vector<int32_t>& prompt, const GenerationOptions& options,
                                   const std::function<bool(int32_t)>& on_token);

 private:
  DeepseekModel& model_;
  Sampler sampler_;
  std::vector<float> logits_;
};

}  // namespace moat
