// The engine core: step() = schedule -> run the model on the batch -> sample -> update requests
// -> emit outputs. One thread owns it (the model, the paged cache and the scheduler);
// `moat generate` drives it directly, and a server puts a thread-safe queue in front of it.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/latent_cache.h"
#include "models/deepseek_v3.h"
#include "sample/sampler.h"
#include "sched/scheduler.h"
#include "spec/proposer.h"
#include "tokenizer/tokenizer.h"

namespace moat {

// Speculative decoding (src/spec): a proposer guesses up to num_tokens tokens per decoding
// request after each step; the next step verifies them in the same forward that decodes.
struct SpeculativeConfig {
  std::string method;          // "" (off), "ngram", "draft" or "mtp"
  int32_t num_tokens = 4;      // guesses per request per step, [1, 64]
  // "draft": the draft model; "mtp": the target checkpoint's MTP head (DeepseekModel::Options::mtp).
  // The caller's, alive as long as the engine.
  DeepseekModel* draft_model = nullptr;
  int32_t ngram_min = 2, ngram_max = 4;  // "ngram": suffix lengths looked up, longest first
  // Adaptive k: a request guesses only as far as the j-th guess is still accepted with
  // probability alpha^j >= min_guess_acceptance, alpha its own moving acceptance rate (at least
  // one guess, so a rate can recover). 0: always num_tokens.
  double min_guess_acceptance = 0.25;
  // No guesses while more requests than this decode at once: a wide batch already reads every
  // expert, so verification tokens cost nearly what real ones do (vLLM's disable_by_batch_size).
  // 0: no limit.
  int32_t disable_by_batch_size = 0;
  bool enabled() const { return !method.empty(); }
};

struct EngineConfig {
  int32_t block_size = 64;               // tokens per KV block
  int64_t kv_memory_bytes = 0;           // latent cache size; 0: room for max_num_seqs full contexts,
                                         // at most half the memory available when the engine starts
  int64_t max_model_len = 0;             // prompt + output per request; 0: the model's max context
  int64_t max_num_batched_tokens = 512;  // token budget per step (prompt chunks + decode tokens)
  int32_t max_num_seqs = 64;             // running requests at once
  bool enable_prefix_caching = true;
  // Hybrid models: recurrent-state snapshots kept for prefix caching (sched/scheduler.h); -1:
  // 2 x max_num_seqs, fewer if memory is short; 0: hybrids take no prefix hits.
  int32_t prefix_state_snapshots = -1;
  SpeculativeConfig speculative;
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopConditions stop;
};

// What one step produced for one request.
struct RequestOutput {
  uint64_t id = 0;
  std::vector<int32_t> new_tokens;  // sampled this step (a stop token included)
  std::vector<SampledToken> logprobs;  // one per new token when the request asked for logprobs
  std::string text;                 // newly final text (needs a tokenizer); stop strings held back
  bool finished = false;
  FinishReason finish_reason = FinishReason::none;
  std::string stop_string;          // the stop string that ended it, if one did
  int64_t prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  int64_t draft_tokens = 0, accepted_tokens = 0, spec_steps = 0;  // speculative decoding, so far
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prompt_tokens_computed = 0;  // prompt rows the model computed (prefix hits and their blocks excluded;
                                       // a preempted request's prompt counts again when recomputed)
  int64_t generated_tokens = 0;
  // speculative decoding: tokens proposed and verified, accepted of those, verification steps
  int64_t draft_tokens = 0, accepted_tokens = 0, spec_steps = 0;
  double acceptance_rate() const { return draft_tokens ? static_cast<double>(accepted_tokens) / draft_tokens : 0.0; }
  // tokens emitted per verification step (accepted + the target's own)
  double mean_accepted_length() const {
    return spec_steps ? static_cast<double>(accepted_tokens + spec_steps) / spec_steps : 0.0;
  }
};

class Engine {
 public:
  // tokenizer: optional; without it outputs carry tokens only and stop strings are refused.
  static Result<std::unique_ptr<Engine>> create(DeepseekModel& model, const EngineConfig& config,
                                                const Tokenizer* tokenizer = nullptr);

  // Whether the request can run on this engine (parameters, vocabulary, context, cache size).
  // Reads only what never changes after create(), so any thread may call it.
  Status validate(const GenerateRequest& request) const;
  // Validates and queues a request; returns its id (`id` when given, else the next free one).
  // Errors name the parameter at fault.
  Result<uint64_t> add_request(GenerateRequest request, std::optional<uint64_t> id = std::nullopt);
  // Finishes a request at once (reason abort) and frees its blocks; unknown ids are ignored.
  void abort(uint64_t id);
  bool has_work() const { return scheduler_->has_work() || !pending_finished_.empty(); }
  std::vector<RequestOutput> step();

  // Replaces the proposer (tests script their own; nullptr turns speculation off); guesses of at
  // most num_tokens per request and step.
  void set_proposer(std::unique_ptr<Proposer> proposer, int32_t num_tokens) {
    proposer_ = std::move(proposer);
    config_.speculative.num_tokens = num_tokens;
  }
  const Proposer* proposer() const { return proposer_.get(); }

  const Scheduler& scheduler() const { return *scheduler_; }
  const EngineStats& stats() const { return stats_; }
  const PagedLatentCache& cache() const { return *cache_; }
  const EngineConfig& config() const { return config_; }
  DeepseekModel& model() { return model_; }

 private:
  Engine(DeepseekModel& model, const EngineConfig& config, const Tokenizer* tokenizer);
  struct TextState {
    std::optional<IncrementalDetokenizer> detok;
    std::string held;  // decoded text not yet emitted: it may be the start of a stop string
  };
  // Appends the text of `tokens` to out.text, holding back what may start a stop string; ends the
  // request when one matches.
  void emit_text(Request& r, TextState& state, std::span<const int32_t> tokens, RequestOutput& out);
  void fill_counts(const Request& r, RequestOutput& out) const;
  // Samples every sampling chunk's logits rows (logits_, in chunk order): one token for a plain
  // chunk, the verified prefix of the proposal plus one token for a verification chunk.
  void sample_and_verify(std::span<const ScheduledChunk* const> chunks, std::vector<std::vector<int32_t>>& emitted,
                         std::vector<std::vector<SampledToken>>& logprobs);
  // Asks the proposer for the next step's guesses of every request that decodes next.
  void propose_next();

  DeepseekModel& model_;
  EngineConfig config_;
  const Tokenizer* tokenizer_;
  std::unique_ptr<PagedLatentCache> cache_;
  std::unique_ptr<Scheduler> scheduler_;
  Sampler sampler_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, TextState> text_;
  std::vector<RequestOutput> pending_finished_;  // aborted between steps
  std::vector<float> logits_;
  std::vector<SampledToken> samples_;
  std::unique_ptr<Proposer> proposer_;
  std::vector<float> spec_target_probs_;   // [1 + k, vocab] one verification's target distributions
  std::vector<int32_t> spec_history_;      // output + proposal of the request being verified
  std::vector<float> hidden_;              // [T, hidden] the step's final hidden states, for an MTP proposer
  EngineStats stats_;
};

// MemAvailable from /proc/meminfo, in bytes (0 when unknown); the loader's figure, which tests
// can fake (loader/safetensors.h set_mem_available_for_testing).
int64_t available_memory_bytes();

}  // namespace moat
