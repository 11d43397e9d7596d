#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "kv/state_pool.h"
#include "loader/safetensors.h"
#include "runner/model_runner.h"
#include "spec/draft_proposer.h"
#include "spec/mtp_proposer.h"
#include "spec/ngram_proposer.h"
#include "spec/rejection_sampler.h"

namespace moat {

// The loader's reading of MemAvailable, so tests can fake it for both (set_mem_available_for_testing).
int64_t available_memory_bytes() { return static_cast<int64_t>(mem_available_bytes()); }

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
  // Hybrid models keep a recurrent state per running request (Kimi K3: 0.46 GB each), all of which
  // may be touched at once: refuse now, with the numbers, rather than be killed for memory later.
  const int64_t state_bytes = model.state_bytes_per_request() * c.max_num_seqs;
  if (state_bytes > 0 && available > 0 && bytes + state_bytes > available)
    return make_error(
        "{} running requests (--max-num-seqs) keep {} bytes of recurrent state each, {} bytes in all, which with the "
        "KV cache's {} bytes exceeds the {} bytes of memory available; lower --max-num-seqs or --kv-memory",
        c.max_num_seqs, model.state_bytes_per_request(), state_bytes, bytes, available);
  // Snapshots of those states let hybrids take prefix-cache hits; they are a cache, so by default
  // as many as fit beside the rest. Under tensor parallelism each rank snapshots its heads' share
  // (DeepseekModel::mirror_state_snapshot), so the sizes here are per rank too.
  int32_t snapshots = 0;
  if (const int64_t per_state = model.state_bytes_per_request(); per_state > 0 && c.enable_prefix_caching) {
    if (c.prefix_state_snapshots < -1)
      return make_error("--prefix-state-snapshots must be >= 0, got {}", c.prefix_state_snapshots);
    if (c.prefix_state_snapshots >= 0) {
      snapshots = c.prefix_state_snapshots;
      if (available > 0 && bytes + state_bytes + snapshots * per_state > available)
        return make_error("--prefix-state-snapshots {} x {} bytes of recurrent state, with the KV cache and the running "
                          "requests' states, exceeds the {} bytes of memory available",
                          snapshots, per_state, available);
    } else {
      snapshots = static_cast<int32_t>(default_state_snapshots(
          c.max_num_seqs, per_state,
          available > 0 ? std::optional<int64_t>(available - bytes - state_bytes) : std::nullopt));
    }
  }

  std::unique_ptr<Proposer> proposer;
  if (const SpeculativeConfig& sp = c.speculative; sp.enabled()) {
    if (sp.num_tokens < 1 || sp.num_tokens > 64)
      return make_error("--num-speculative-tokens must be in [1, 64], got {}", sp.num_tokens);
    if (sp.method == "ngram") {
      if (sp.ngram_min < 1 || sp.ngram_max < sp.ngram_min)
        return make_error("n-gram lookup needs 1 <= min <= max, got min {} max {}", sp.ngram_min, sp.ngram_max);
      proposer = std::make_unique<NgramProposer>(sp.ngram_min, sp.ngram_max);
    } else if (sp.method == "draft") {
      if (!sp.draft_model) return make_error("--speculative draft needs a draft model");
      MOAT_ASSIGN_OR_RETURN(proposer, DraftModelProposer::create(*sp.draft_model, model.config().vocab_size,
                                                                 c.max_num_seqs, c.max_model_len, c.block_size));
    } else if (sp.method == "mtp") {
      if (!sp.draft_model) return make_error("--speculative mtp needs the checkpoint's MTP head loaded");
      MOAT_ASSIGN_OR_RETURN(proposer, MtpProposer::create(*sp.draft_model, model.config().vocab_size,
                                                          model.config().hidden_size, static_cast<int32_t>(num_blocks),
                                                          c.block_size, c.max_num_seqs, sp.num_tokens));
    } else {
      return make_error("--speculative {}: unknown method (draft:DIR, ngram or mtp)", sp.method);
    }
  }

  std::unique_ptr<Engine> e(new Engine(model, c, tokenizer));
  e->proposer_ = std::move(proposer);
  e->cache_ = std::make_unique<PagedLatentCache>(model.cache_shape(), static_cast<int32_t>(num_blocks), c.block_size);
  SchedulerConfig sc;
  sc.num_blocks = static_cast<int32_t>(num_blocks);
  sc.block_size = c.block_size;
  sc.max_num_batched_tokens = c.max_num_batched_tokens;
  sc.max_num_seqs = c.max_num_seqs;
  sc.max_model_len = c.max_model_len;
  sc.enable_prefix_caching = c.enable_prefix_caching;
  sc.state_bytes_per_request = model.state_bytes_per_request();
  sc.num_state_slots = sc.state_bytes_per_request > 0 ? c.max_num_seqs : 0;
  sc.num_state_snapshots = snapshots;
  e->scheduler_ = std::make_unique<Scheduler>(sc);
  if (snapshots > 0 && model.tp_size() > 1)
    e->scheduler_->set_snapshot_mirror([&model, pool = &e->scheduler_->state_pool(), snapshots](bool save, uint64_t hash,
                                                                                              int32_t slot) {
      model.mirror_state_snapshot(*pool, snapshots, save, hash, slot);
    });
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
  out.draft_tokens = r.num_draft_tokens;
  out.accepted_tokens = r.num_accepted_tokens;
  out.spec_steps = r.num_spec_steps;
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

void Engine::sample_and_verify(std::span<const ScheduledChunk* const> chunks,
                               std::vector<std::vector<int32_t>>& emitted,
                               std::vector<std::vector<SampledToken>>& logprobs) {
  const int64_t V = model_.config().vocab_size;
  const size_t n = chunks.size();
  emitted.assign(n, {});
  logprobs.assign(n, {});
  std::vector<SamplingRow> rows;
  int64_t row = 0;  // first logits row of chunk i
  for (size_t i = 0; i < n;) {
    if (chunks[i]->num_spec == 0) {  // a run of plain chunks: one batched sample
      size_t e = i;
      rows.clear();
      for (; e < n && chunks[e]->num_spec == 0; ++e) {
        Request& r = *chunks[e]->request;
        rows.push_back({&r.sampling, &r.rng, r.prompt, r.output});
      }
      const int64_t R = static_cast<int64_t>(e - i);
      samples_.resize(static_cast<size_t>(R));
      sampler_.sample(logits_.data() + row * V, R, V, rows, samples_);
      for (size_t j = i; j < e; ++j) {
        SampledToken& s = samples_[j - i];
        emitted[j] = {s.token};
        if (chunks[j]->request->sampling.wants_logprobs()) logprobs[j].push_back(std::move(s));
      }
      row += R;
      i = e;
      continue;
    }
    // A verification: rows 0..k are the target's logits after the last token and after each
    // guess; each row's penalties see the output as it would be with the guesses before it.
    Request& r = *chunks[i]->request;
    const int64_t k = chunks[i]->num_spec;
    MOAT_CHECK(static_cast<int64_t>(r.spec_tokens.size()) == k, "{} guesses on the request, {} scheduled",
               r.spec_tokens.size(), k);
    spec_history_.assign(r.output.begin(), r.output.end());
    spec_history_.insert(spec_history_.end(), r.spec_tokens.begin(), r.spec_tokens.end());
    rows.clear();
    for (int64_t p = 0; p <= k; ++p)
      rows.push_back({&r.sampling, &r.rng, r.prompt,
                      std::span<const int32_t>(spec_history_.data(), r.output.size() + static_cast<size_t>(p))});
    float* logits = logits_.data() + row * V;
    spec_target_probs_.resize(static_cast<size_t>((k + 1) * V));
    sampler_.probabilities(logits, k + 1, V, rows, spec_target_probs_.data());
    const Verification v = verify_proposal(model_.ops(), spec_target_probs_.data(), r.spec_probs,
                                           r.spec_tokens, V, r.rng);
    emitted[i].assign(r.spec_tokens.begin(), r.spec_tokens.begin() + v.accepted);
    emitted[i].push_back(v.token);
    if (r.sampling.wants_logprobs()) {
      logprobs[i].resize(emitted[i].size());
      sampler_.logprobs(logits, static_cast<int64_t>(emitted[i].size()), V, rows, emitted[i], logprobs[i]);
    }
    const double rate = static_cast<double>(v.accepted) / static_cast<double>(k);
    r.spec_acceptance = r.spec_acceptance < 0 ? rate : 0.7 * r.spec_acceptance + 0.3 * rate;
    stats_.draft_tokens += k;
    stats_.accepted_tokens += v.accepted;
    ++stats_.spec_steps;
    row += k + 1;
    ++i;
  }
  MOAT_CHECK(row * V == static_cast<int64_t>(logits_.size()), "{} logits rows used of {}", row,
             logits_.size() / static_cast<size_t>(V));
}

void Engine::propose_next() {
  if (!proposer_) return;
  const SpeculativeConfig& sp = config_.speculative;
  std::vector<ProposeRequest> requests;
  for (Request* r : scheduler_->running()) {
    if (r->finished() || r->num_computed_tokens != r->length() - 1) continue;  // still prefilling
    // Guesses and the token after them must fit the request's limits.
    const int64_t room = std::min(r->stop.max_tokens - static_cast<int64_t>(r->output.size()),
                                  config_.max_model_len - r->length()) - 1;
    int64_t k = std::min<int64_t>(sp.num_tokens, room);
    if (sp.min_guess_acceptance > 0 && r->spec_acceptance >= 0 && r->spec_acceptance < 1) {
      const double alpha = std::max(r->spec_acceptance, 1e-3);
      k = std::min<int64_t>(k, std::max<int64_t>(1, static_cast<int64_t>(std::log(sp.min_guess_acceptance) / std::log(alpha))));
    }
    if (k >= 1) requests.push_back({r, static_cast<int32_t>(k)});
  }
  if (sp.disable_by_batch_size > 0 && static_cast<int64_t>(requests.size()) > sp.disable_by_batch_size) return;
  if (!requests.empty()) proposer_->propose(requests);
}

std::vector<RequestOutput> Engine::step() {
  ScopedThreadPool pool_scope(model_.thread_pool());  // sampling kernels run on the model's pool too
  std::vector<RequestOutput> outputs = std::move(pending_finished_);
  pending_finished_.clear();
  const SchedulerOutput scheduled = scheduler_->schedule();
  if (!scheduled.empty()) {
    const int64_t V = model_.config().vocab_size;
    const ForwardBatch batch = build_forward_batch(scheduled, scheduler_->config().block_size);
    const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
    logits_.resize(static_cast<size_t>(R * V));
    const bool wants_hidden = proposer_ && proposer_->wants_target_hidden();
    if (wants_hidden) hidden_.resize(static_cast<size_t>(batch.num_tokens() * model_.config().hidden_size));
    // A hybrid model (KDA layers) keeps the state after each verified token, so a request whose
    // guesses were rejected is put back at its accepted position below.
    const bool rewinds = proposer_ && model_.state_bytes_per_request() > 0;
    model_.forward(batch, *cache_, logits_.data(), nullptr,
                   {.final_hidden = wants_hidden ? hidden_.data() : nullptr,
                    .states = &scheduler_->state_pool(),
                    .keep_step_states = rewinds});

    std::vector<const ScheduledChunk*> sampling;
    for (const ScheduledChunk& c : scheduled.chunks) {
      const int64_t prompt_len = static_cast<int64_t>(c.request->prompt.size());
      stats_.prompt_tokens_computed += std::max<int64_t>(0, std::min(c.first + c.num_tokens, prompt_len) - c.first);
      if (c.samples()) sampling.push_back(&c);
    }
    std::vector<std::vector<int32_t>> emitted;
    std::vector<std::vector<SampledToken>> logprobs;
    sample_and_verify(sampling, emitted, logprobs);
    if (rewinds) {
      // A verification chunk ends in [last token, k guesses]; the state must stand after the last
      // token and the accepted guesses (emitted = accepted + 1 tokens), not after all k + 1.
      for (size_t i = 0; i < sampling.size(); ++i) {
        const ScheduledChunk& c = *sampling[i];
        const int64_t kept = c.num_tokens - c.num_spec - 1 + static_cast<int64_t>(emitted[i].size());
        if (c.num_spec > 0 && kept < c.num_tokens)
          model_.rewind_state(static_cast<int32_t>(&c - scheduled.chunks.data()), kept, scheduler_->state_pool(),
                              c.request->state_slot);
      }
    }
    std::vector<size_t> before(sampling.size());
    for (size_t i = 0; i < sampling.size(); ++i) before[i] = sampling[i]->request->output.size();
    scheduler_->update(scheduled, emitted);
    ++stats_.steps;
    if (wants_hidden) proposer_->observe_target_step(scheduled, hidden_);

    for (size_t i = 0; i < sampling.size(); ++i) {
      Request& r = *sampling[i]->request;
      RequestOutput out;
      out.id = r.id;
      out.new_tokens.assign(r.output.begin() + static_cast<int64_t>(before[i]), r.output.end());
      stats_.generated_tokens += static_cast<int64_t>(out.new_tokens.size());
      if (r.sampling.wants_logprobs()) {
        logprobs[i].resize(std::min(logprobs[i].size(), out.new_tokens.size()));
        out.logprobs = std::move(logprobs[i]);
      }
      // A stop token ends the request without text of its own.
      std::span<const int32_t> text_tokens(out.new_tokens);
      if (r.finished() && r.finish == FinishReason::stop && !text_tokens.empty()) text_tokens = text_tokens.first(text_tokens.size() - 1);
      auto it = text_.find(r.id);
      if (it != text_.end()) emit_text(r, it->second, text_tokens, out);
      fill_counts(r, out);
      outputs.push_back(std::move(out));
    }
  }
  for (auto& done : scheduler_->take_finished()) {
    text_.erase(done->id);
    if (proposer_) proposer_->release(done->id);
  }
  propose_next();
  return outputs;
}

}  // namespace moat
