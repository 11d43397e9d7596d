#include "engine/engine.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include "runner/model_runner.h"

namespace moat {

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

Engine::Engine(DeepseekModel& model, const EngineConfig& config, const Tokenizer* tokenizer)
    : model_(model), config_(config), tokenizer_(tokenizer), sampler_(model.ops()) {}

Result<std::unique_ptr<Engine>> Engine::create(DeepseekModel& model, const EngineConfig& config,
                                               const Tokenizer* tokenizer) {
  EngineConfig c = config;
  if (c.max_model_len <= 0) c.max_model_len = model.max_context();
  if (c.max_model_len > model.max_context())
    return make_error("max model length {} exceeds the context the model was loaded for ({})", c.max_model_len,
                      model.max_context());
  if (c.block_size <= 0 || c.block_size > 4096) return make_error("--block-size must be in [1, 4096], got {}", c.block_size);
  if (c.max_num_seqs <= 0) return make_error("--max-num-seqs must be >= 1, got {}", c.max_num_seqs);
  if (c.max_num_batched_tokens <= 0)
    return make_error("--max-num-batched-tokens must be >= 1, got {}", c.max_num_batched_tokens);

  const int64_t per_token = model.cache_shape().bytes_per_token();
  const int64_t per_block = per_token * c.block_size;
  const int64_t blocks_per_context = (c.max_model_len + c.block_size - 1) / c.block_size;
  const int64_t available = available_memory_bytes();
  int64_t bytes = c.kv_memory_bytes;
  if (bytes > 0) {
    if (available > 0 && bytes > available)
      return make_error("--kv-memory {} bytes: only {} bytes of memory are available", bytes, available);
  } else {
    bytes = blocks_per_context * c.max_num_seqs * per_block;
    if (available > 0) bytes = std::min(bytes, available / 2);
  }
  const int64_t num_blocks = bytes / per_block;
  if (num_blocks < blocks_per_context)
    return make_error(
        "the KV cache ({} bytes, {} blocks of {} tokens at {} bytes per token) cannot hold one context of {} tokens "
        "({} bytes needed{}); lower --max-context or raise --kv-memory",
        bytes, num_blocks, c.block_size, per_token, c.max_model_len, blocks_per_context * per_block,
        available > 0 ? fmt::format(", {} bytes of memory available", available) : std::string());
  if (num_blocks > INT32_MAX) return make_error("--kv-memory {} bytes is more blocks than block ids can name", bytes);

  std::unique_ptr<Engine> e(new Engine(model, c, tokenizer));
  e->cache_ = std::make_unique<PagedLatentCache>(model.cache_shape(), static_cast<int32_t>(num_blocks), c.block_size);
  SchedulerConfig sc;
  sc.num_blocks = static_cast<int32_t>(num_blocks);
  sc.block_size = c.block_size;
  sc.max_num_batched_tokens = c.max_num_batched_tokens;
  sc.max_num_seqs = c.max_num_seqs;
  sc.max_model_len = c.max_model_len;
  sc.enable_prefix_caching = c.enable_prefix_caching;
  e->scheduler_ = std::make_unique<Scheduler>(sc);
  return e;
}

Status Engine::validate(const GenerateRequest& request) const {
  const int64_t V = model_.config().vocab_size;
  MOAT_TRY(request.sampling.validate(V));
  if (request.prompt.empty()) return make_error("the prompt is empty: at least one token is needed");
  for (int32_t id : request.prompt)
    if (id < 0 || id >= V) return make_error("prompt token id {} outside the vocabulary of {}", id, V);
  if (request.stop.max_tokens < 1) return make_error("max_tokens must be >= 1, got {}", request.stop.max_tokens);
  if (request.stop.min_tokens < 0 || request.stop.min_tokens > request.stop.max_tokens)
    return make_error("min_tokens must be in [0, max_tokens = {}], got {}", request.stop.max_tokens,
                      request.stop.min_tokens);
  for (int32_t id : request.stop.stop_token_ids)
    if (id < 0 || id >= V) return make_error("stop_token_ids: {} outside the vocabulary of {}", id, V);
  for (const std::string& s : request.stop.stop_strings)
    if (s.empty()) return make_error("stop: empty stop strings are not allowed");
  if (!request.stop.stop_strings.empty() && !tokenizer_)
    return make_error("stop strings need a tokenizer, and this engine has none");
  return scheduler_->check_fits(static_cast<int64_t>(request.prompt.size()), request.stop.max_tokens);
}

Result<uint64_t> Engine::add_request(GenerateRequest request, std::optional<uint64_t> id) {
  MOAT_TRY(validate(request));
  const uint64_t rid = id.value_or(next_id_);
  next_id_ = std::max(next_id_, rid + 1);
  auto r = std::make_unique<Request>();
  r->id = rid;
  r->prompt = std::move(request.prompt);
  r->sampling = request.sampling;
  r->stop = std::move(request.stop);
  // Unseeded requests get a seed of their own, so they differ from each other (OpenAI semantics).
  r->rng.seed(r->sampling.seed ? *r->sampling.seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}());
  MOAT_TRY(scheduler_->add(std::move(r)));
  TextState& t = text_[rid];
  if (tokenizer_) t.detok.emplace(*tokenizer_);
  return rid;
}

void Engine::fill_counts(const Request& r, RequestOutput& out) const {
  out.prompt_tokens = static_cast<int64_t>(r.prompt.size());
  out.output_tokens = static_cast<int64_t>(r.output.size());
  out.cached_tokens = r.num_cached_tokens;
  out.finished = r.finished();
  out.finish_reason = r.finish;
}

void Engine::abort(uint64_t id) {
  Request* r = scheduler_->find(id);
  if (!r || r->finished()) return;
  scheduler_->finish(id, FinishReason::abort);
  RequestOutput out;
  out.id = id;
  fill_counts(*r, out);
  pending_finished_.push_back(std::move(out));
}

void Engine::emit_text(Request& r, TextState& state, std::span<const int32_t> tokens, RequestOutput& out) {
  if (!state.detok) return;
  for (int32_t t : tokens) state.held += state.detok->push(t);
  if (r.finished()) state.held += state.detok->flush();
  const auto& stops = r.stop.stop_strings;
  if (!stops.empty() && static_cast<int64_t>(r.output.size()) > r.stop.min_tokens) {
    size_t best = std::string::npos;
    const std::string* match = nullptr;
    for (const std::string& s : stops)
      if (size_t p = state.held.find(s); p != std::string::npos && p < best) best = p, match = &s;
    if (match) {
      out.text += state.held.substr(0, best);
      out.stop_string = *match;
      state.held.clear();
      if (!r.finished()) scheduler_->finish(r.id, FinishReason::stop);
      r.finish = FinishReason::stop;  // a stop string outranks a length limit reached in the same step
      return;
    }
  }
  size_t keep = 0;
  if (!r.finished())
    for (const std::string& s : stops)
      for (size_t n = std::min(s.size() - 1, state.held.size()); n > keep; --n)
        if (state.held.compare(state.held.size() - n, n, s, 0, n) == 0) {
          keep = n;
          break;
        }
  out.text += state.held.substr(0, state.held.size() - keep);
  state.held.erase(0, state.held.size() - keep);
}

std::vector<RequestOutput> Engine::step() {
  std::vector<RequestOutput> outputs = std::move(pending_finished_);
  pending_finished_.clear();
  const SchedulerOutput scheduled = scheduler_->schedule();
  if (!scheduled.empty()) {
    const int64_t V = model_.config().vocab_size;
    const ForwardBatch batch = build_forward_batch(scheduled, scheduler_->config().block_size);
    const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
    logits_.resize(static_cast<size_t>(R * V));
    model_.forward(batch, *cache_, logits_.data());

    std::vector<Request*> sampling;
    std::vector<SamplingRow> rows;
    for (const ScheduledChunk& c : scheduled.chunks) {
      Request& r = *c.request;
      const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
      stats_.prompt_tokens_computed += std::max<int64_t>(0, std::min(c.first + c.num_tokens, prompt_len) - c.first);
      if (!c.samples()) continue;
      sampling.push_back(&r);
      rows.push_back({&r.sampling, &r.rng, r.prompt, r.output});
    }
    MOAT_CHECK(static_cast<int64_t>(rows.size()) == R, "{} logit rows for {} sampling chunks", R, rows.size());
    samples_.resize(rows.size());
    sampler_.sample(logits_.data(), R, V, rows, samples_);
    std::vector<int32_t> sampled(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) sampled[i] = samples_[i].token;
    scheduler_->update(scheduled, sampled);
    stats_.generated_tokens += R;
    ++stats_.steps;

    for (size_t i = 0; i < sampling.size(); ++i) {
      Request& r = *sampling[i];
      RequestOutput out;
      out.id = r.id;
      out.new_tokens = {sampled[i]};
      if (r.sampling.wants_logprobs()) out.logprobs.push_back(std::move(samples_[i]));
      // A stop token ends the request without text of its own.
      const bool stop_token = r.finished() && r.finish == FinishReason::stop;
      auto it = text_.find(r.id);
      if (it != text_.end())
        emit_text(r, it->second, stop_token ? std::span<const int32_t>() : std::span<const int32_t>(out.new_tokens), out);
      fill_counts(r, out);
      outputs.push_back(std::move(out));
    }
  }
  for (auto& done : scheduler_->take_finished()) text_.erase(done->id);
  return outputs;
}

}  // namespace moat
