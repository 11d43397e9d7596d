#include "engine/generator.h"

#include <algorithm>
#include <chrono>

namespace moat {

Result<GenerationStats> Generator::generate(const std::vector<int32_t>& prompt, const GenerationOptions& options,
                                            const std::function<bool(int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = model_.config();
  MOAT_TRY(options.sampling.validate());
  if (prompt.empty()) return make_error("prompt is empty: at least one token is needed");
  if (options.max_new_tokens < 0) return make_error("max tokens must be >= 0, got {}", options.max_new_tokens);
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  if (total > model_.max_context())
    return make_error("prompt ({} tokens) + max tokens ({}) = {} exceeds the context of {} tokens",
                      prompt.size(), options.max_new_tokens, total, model_.max_context());
  for (int32_t id : prompt)
    if (id < 0 || id >= c.vocab_size) return make_error("token id {} outside the vocabulary of {}", id, c.vocab_size);

  GenerationStats stats;
  stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  auto cache = model_.new_cache(std::max<int64_t>(total, 1));
  logits_.resize(static_cast<size_t>(c.vocab_size));
  std::mt19937_64 rng(options.sampling.seed);

  const auto start = Clock::now();
  const int64_t chunk = std::max<int64_t>(1, options.prefill_chunk);
  for (int64_t begin = 0; begin < stats.prompt_tokens; begin += chunk) {
    const int64_t end = std::min(stats.prompt_tokens, begin + chunk);
    const std::vector<int32_t> chunk_tokens(prompt.begin() + begin, prompt.begin() + end);
    const ForwardBatch batch = ForwardBatch::for_sequence(chunk_tokens, static_cast<int32_t>(begin), cache.get());
    model_.forward(batch, logits_.data());
  }
  auto first_token_time = Clock::now();
  stats.prefill_seconds = std::chrono::duration<double>(first_token_time - start).count();

  int64_t position = stats.prompt_tokens;
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const int32_t token = sampler_.sample(logits_.data(), c.vocab_size, options.sampling, rng);
    if (!options.ignore_eos &&
        std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), token) != options.stop_token_ids.end()) {
      stats.stopped_on_eos = true;
      break;
    }
    ++stats.generated_tokens;
    if (n == 0) {
      first_token_time = Clock::now();
      stats.prefill_seconds = std::chrono::duration<double>(first_token_time - start).count();
    }
    if (on_token && !on_token(token)) break;
    if (n + 1 == options.max_new_tokens) break;
    const ForwardBatch step = ForwardBatch::for_sequence({token}, static_cast<int32_t>(position++), cache.get());
    model_.forward(step, logits_.data());
  }
  stats.decode_seconds = std::chrono::duration<double>(Clock::now() - first_token_time).count();
  return stats;
}

}  // namespace moat
