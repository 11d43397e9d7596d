#include "sched/scheduler.h"

#include <algorithm>

#include "base/check.h"

namespace moat {

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      pool_(config.num_blocks, config.block_size),
      state_pool_(config.state_bytes_per_request > 0 ? config.num_state_slots : 0, config.state_bytes_per_request),
      snapshots_(config.enable_prefix_caching ? config.num_state_snapshots : 0, config.state_bytes_per_request) {
  MOAT_CHECK(config.max_num_batched_tokens > 0 && config.max_num_seqs > 0, "empty token budget or sequence limit");
  MOAT_CHECK(config.state_bytes_per_request == 0 || config.num_state_slots > 0,
             "a model with recurrent state needs state slots");
}

Status Scheduler::check_fits(int64_t prompt_tokens, int64_t max_tokens) const {
  // Compared without adding first: a max_tokens near INT64_MAX must not wrap around into "fits".
  if (max_tokens > config_.max_model_len - prompt_tokens)
    return make_error("prompt ({} tokens) + max_tokens ({}) exceeds the context of {} tokens", prompt_tokens,
                      max_tokens, config_.max_model_len);
  const int64_t total = prompt_tokens + max_tokens;
  if (blocks_for(total) > pool_.num_blocks())
    return make_error("prompt ({} tokens) + max_tokens ({}) needs {} KV blocks of {} tokens; the cache has {} in all",
                      prompt_tokens, max_tokens, blocks_for(total), config_.block_size, pool_.num_blocks());
  return ok_status();
}

Status Scheduler::add(std::unique_ptr<Request> request) {
  Request& r = *request;
  if (r.prompt.empty()) return make_error("request {}: the prompt is empty", r.id);
  MOAT_TRY(check_fits(static_cast<int64_t>(r.prompt.size()), r.stop.max_tokens));
  if (requests_.count(r.id)) return make_error("request id {} is already in use", r.id);
  r.status = RequestStatus::waiting;
  waiting_.push_back(&r);
  requests_.emplace(r.id, std::move(request));
  return ok_status();
}

Request* Scheduler::find(uint64_t id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

bool Scheduler::grow_blocks(Request& r, int64_t rows) { return pool_.extend(r.block_table, rows); }

void Scheduler::release_blocks(Request& r) {
  // Last blocks first: they join the free queue ahead of the prefix, so a later allocation
  // evicts a request's tail before the shared prefix that other prompts are likelier to reuse.
  for (auto it = r.block_table.rbegin(); it != r.block_table.rend(); ++it) pool_.release(*it);
  r.block_table.clear();
  r.block_hashes.clear();
}

void Scheduler::release_state(Request& r) {
  if (r.state_slot < 0) return;
  state_pool_.release(r.state_slot);
  r.state_slot = -1;
}

void Scheduler::preempt(Request& r) {
  release_blocks(r);
  release_state(r);  // rebuilt from the start by recomputation, like the blocks
  r.spec_tokens.clear();
  r.spec_probs.clear();
  r.num_computed_tokens = 0;
  r.status = RequestStatus::waiting;
  ++r.num_preemptions;
  ++num_preemptions_;
  waiting_.push_front(&r);
}

void Scheduler::register_full_blocks(Request& r) {
  if (!config_.enable_prefix_caching) return;
  const int64_t B = config_.block_size;
  std::vector<int32_t> tokens(static_cast<size_t>(B));
  for (int64_t k = static_cast<int64_t>(r.block_hashes.size()); (k + 1) * B <= r.num_computed_tokens; ++k) {
    for (int64_t i = 0; i < B; ++i) tokens[i] = r.token_or_spec_at(k * B + i);
    const uint64_t parent = k == 0 ? 0 : r.block_hashes[k - 1];
    const uint64_t h = BlockPool::chain_hash(parent, tokens);
    pool_.register_full(r.block_table[k], h, tokens);
    r.block_hashes.push_back(h);
  }
}

// Takes every full block of the request's tokens that the prefix cache holds, up to one token
// short of the whole sequence (the last token must be computed to get logits). With recurrent
// state, only up to the deepest of those blocks whose end has a state snapshot; schedule()
// restores it once the request has a slot.
void Scheduler::admit_prefix(Request& r) {
  r.num_cached_tokens = 0;
  if (!config_.enable_prefix_caching || r.num_computed_tokens > 0) return;
  if (state_pool_.enabled() && !snapshots_.enabled()) return;
  const int64_t B = config_.block_size;
  const int64_t max_blocks = (r.length() - 1) / B;
  std::vector<int32_t> tokens(static_cast<size_t>(B));
  std::vector<uint64_t> hashes;
  int64_t usable = 0;  // blocks to take
  for (int64_t k = 0; k < max_blocks; ++k) {
    for (int64_t i = 0; i < B; ++i) tokens[i] = r.token_at(k * B + i);
    const uint64_t h = BlockPool::chain_hash(k == 0 ? 0 : hashes.back(), tokens);
    if (!pool_.has_cached(h, tokens)) break;
    hashes.push_back(h);
    if (!state_pool_.enabled() || snapshots_.contains(h)) usable = k + 1;
  }
  for (int64_t k = 0; k < usable; ++k) {
    for (int64_t i = 0; i < B; ++i) tokens[i] = r.token_at(k * B + i);
    const std::optional<int32_t> b = pool_.acquire_cached(hashes[k], tokens);
    MOAT_CHECK(b.has_value(), "prefix block {} of request {} vanished between lookup and acquire", k, r.id);
    r.block_table.push_back(*b);
    r.block_hashes.push_back(hashes[k]);
  }
  if (usable < max_blocks) pool_.count_miss();
  r.num_computed_tokens = usable * B;
  r.num_cached_tokens = std::min<int64_t>(r.num_computed_tokens, static_cast<int64_t>(r.prompt.size()));
}

int64_t Scheduler::snapshot_aligned(const Request& r, int64_t first, int64_t n) const {
  if (!state_pool_.enabled() || !snapshots_.enabled()) return n;
  const int64_t B = config_.block_size, end = first + n, known = r.length();
  if (end < known) {  // the budget cut this chunk anyway: cut it on a boundary
    const int64_t aligned = end / B * B;
    return aligned > first ? aligned - first : n;
  }
  // The last chunk: stop where a later request with the same tokens would look for a snapshot.
  const int64_t last_boundary = (known - 1) / B * B;
  return first < last_boundary && last_boundary < end ? last_boundary - first : n;
}

void Scheduler::snapshot_state(Request& r) {
  const int64_t B = config_.block_size, P = r.num_computed_tokens;
  if (!snapshots_.enabled() || r.state_slot < 0 || P == 0 || P % B != 0) return;
  if (static_cast<int64_t>(r.block_hashes.size()) < P / B) return;  // not registered (no caching)
  snapshots_.save(r.block_hashes[P / B - 1], state_pool_.data(r.state_slot));
  if (snapshot_mirror_) snapshot_mirror_(true, r.block_hashes[P / B - 1], r.state_slot);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;

  // 1. Running requests, oldest first; preempt from the newest when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request& r = *running_[i];
    const int64_t known = r.length() - r.num_computed_tokens;
    MOAT_CHECK(known > 0, "running request {} has nothing to compute", r.id);
    // A decoding request verifies its proposal in the same step, as far as the budget allows.
    int64_t spec = known == 1 ? std::min<int64_t>(static_cast<int64_t>(r.spec_tokens.size()), budget - 1) : 0;
    auto drop_spec_beyond = [&r](int64_t keep) {
      if (static_cast<int64_t>(r.spec_tokens.size()) <= keep) return;
      if (!r.spec_probs.empty()) r.spec_probs.resize(r.spec_probs.size() / r.spec_tokens.size() * keep);
      r.spec_tokens.resize(static_cast<size_t>(keep));
    };
    drop_spec_beyond(spec);
    int64_t n = spec > 0 ? std::min(known, budget) + spec
                         : snapshot_aligned(r, r.num_computed_tokens, std::min(known, budget));
    bool fits = grow_blocks(r, r.num_computed_tokens + n);
    if (!fits && spec > 0) {  // give up the guess before taking blocks from anyone
      drop_spec_beyond(0);
      n -= spec;
      spec = 0;
      fits = grow_blocks(r, r.num_computed_tokens + n);
    }
    while (!fits && running_.back() != &r) {
      Request* victim = running_.back();
      running_.pop_back();
      preempt(*victim);
      out.preempted.push_back(victim->id);
      fits = grow_blocks(r, r.num_computed_tokens + n);
    }
    if (!fits) {  // r is the newest running request and still cannot grow: it waits too
      running_.pop_back();
      preempt(r);
      out.preempted.push_back(r.id);
      break;
    }
    out.chunks.push_back({&r, r.num_computed_tokens, n, r.num_computed_tokens + n - spec == r.length(), spec});
    budget -= n;
    ++i;
  }

  // 2. Waiting requests, oldest first (preempted ones are at the front), while there is room.
  while (!waiting_.empty() && budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs &&
         out.preempted.empty()) {
    Request& r = *waiting_.front();
    admit_prefix(r);
    const int64_t n = snapshot_aligned(r, r.num_computed_tokens, std::min(r.length() - r.num_computed_tokens, budget));
    std::optional<int32_t> slot;
    if (state_pool_.enabled() && !(slot = state_pool_.allocate())) {  // waits for a slot
      release_blocks(r);  // prefix blocks go back; they stay cached
      r.num_computed_tokens = 0;
      r.num_cached_tokens = 0;
      break;
    }
    if (!grow_blocks(r, r.num_computed_tokens + n)) {
      release_blocks(r);  // prefix blocks go back; they stay cached
      if (slot) state_pool_.release(*slot);
      r.num_computed_tokens = 0;
      r.num_cached_tokens = 0;
      break;
    }
    r.state_slot = slot.value_or(-1);
    if (slot && r.num_computed_tokens > 0) {
      MOAT_CHECK(snapshots_.restore(r.block_hashes.back(), state_pool_.data(*slot)),
                 "request {} took {} prefix tokens without a state snapshot at their end", r.id, r.num_computed_tokens);
      if (snapshot_mirror_) snapshot_mirror_(false, r.block_hashes.back(), *slot);
    }
    waiting_.pop_front();
    r.status = RequestStatus::running;
    running_.push_back(&r);
    out.chunks.push_back({&r, r.num_computed_tokens, n, r.num_computed_tokens + n == r.length()});
    budget -= n;
  }
  out.num_scheduled_tokens = config_.max_num_batched_tokens - budget;
  return out;
}

void Scheduler::finish_request(Request& r, FinishReason reason) {
  if (r.finished()) return;
  release_blocks(r);
  release_state(r);
  r.status = RequestStatus::finished;
  r.finish = reason;
  running_.erase(std::remove(running_.begin(), running_.end(), &r), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &r), waiting_.end());
  finished_.push_back(r.id);
}

void Scheduler::finish(uint64_t id, FinishReason reason) {
  if (Request* r = find(id)) finish_request(*r, reason);
}

void Scheduler::update(const SchedulerOutput& out, std::span<const int32_t> sampled) {
  std::vector<std::vector<int32_t>> emitted(sampled.size());
  for (size_t i = 0; i < sampled.size(); ++i) emitted[i] = {sampled[i]};
  update(out, emitted);
}

void Scheduler::update(const SchedulerOutput& out, std::span<const std::vector<int32_t>> emitted) {
  size_t next = 0;
  for (const ScheduledChunk& c : out.chunks) {
    Request& r = *c.request;
    const bool samples = c.samples();
    if (r.finished()) {                // aborted while the step ran
      if (samples) ++next;
      continue;
    }
    if (!samples) {
      r.num_computed_tokens = c.first + c.num_tokens;
      register_full_blocks(r);
      snapshot_state(r);
      continue;
    }
    MOAT_CHECK(next < emitted.size(), "{} emitted token lists for more sampling chunks", emitted.size());
    const std::vector<int32_t>& tokens = emitted[next++];
    const int64_t accepted = static_cast<int64_t>(tokens.size()) - 1;
    MOAT_CHECK(accepted >= 0 && accepted <= c.num_spec, "{} tokens emitted for a chunk of {} speculative tokens",
               tokens.size(), c.num_spec);
    for (int64_t i = 0; i < accepted; ++i)
      MOAT_CHECK(tokens[i] == r.spec_tokens[i], "accepted token {} is not the proposal's {}", tokens[i],
                 r.spec_tokens[i]);
    // Rows of the accepted guesses are the rows of the tokens they became; the rest are garbage
    // past num_computed_tokens, overwritten when those positions are computed again.
    r.num_computed_tokens = c.first + c.num_tokens - c.num_spec + accepted;
    if (c.num_spec > 0) {
      r.num_draft_tokens += c.num_spec;
      r.num_accepted_tokens += accepted;
      ++r.num_spec_steps;
    }
    register_full_blocks(r);  // reads the accepted guesses as spec tokens: they join output below
    snapshot_state(r);        // the engine rewound the state to num_computed_tokens
    r.spec_tokens.clear();
    r.spec_probs.clear();
    for (const int32_t token : tokens) {
      r.output.push_back(token);
      const int64_t generated = static_cast<int64_t>(r.output.size());
      const auto is = [token](const std::vector<int32_t>& ids) {
        return std::find(ids.begin(), ids.end(), token) != ids.end();
      };
      if (generated > r.stop.min_tokens &&
          (is(r.stop.stop_token_ids) || (!r.stop.ignore_eos && is(r.stop.eos_token_ids)))) {
        finish_request(r, FinishReason::stop);
        break;
      }
      if (generated >= r.stop.max_tokens || r.length() >= config_.max_model_len) {
        finish_request(r, FinishReason::length);
        break;
      }
    }
    // blocks that only held rejected guesses
    while (!r.finished() && static_cast<int64_t>(r.block_table.size()) > blocks_for(r.length())) {
      pool_.release(r.block_table.back());
      r.block_table.pop_back();
    }
  }
  MOAT_CHECK(next == emitted.size(), "{} emitted token lists for {} sampling chunks", emitted.size(), next);
}

std::vector<std::unique_ptr<Request>> Scheduler::take_finished() {
  std::vector<std::unique_ptr<Request>> done;
  for (uint64_t id : finished_) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    done.push_back(std::move(it->second));
    requests_.erase(it);
  }
  finished_.clear();
  return done;
}

void Scheduler::check_invariants() const {
  pool_.check_invariants();
  state_pool_.check_invariants();
  snapshots_.check_invariants();
  int32_t slots_held = 0;
  for (const auto& [id, r] : requests_) {
    if (r->state_slot < 0) continue;
    ++slots_held;
    MOAT_CHECK(r->status == RequestStatus::running, "request {} holds state slot {} while not running", id, r->state_slot);
    MOAT_CHECK(state_pool_.in_use(r->state_slot), "request {} holds state slot {}, which the pool calls free", id,
               r->state_slot);
  }
  MOAT_CHECK(slots_held + state_pool_.num_free() == state_pool_.num_slots(), "{} state slots held, {} free of {}",
             slots_held, state_pool_.num_free(), state_pool_.num_slots());
  std::vector<int32_t> held(static_cast<size_t>(pool_.num_blocks()), 0);
  for (const auto& [id, r] : requests_) {
    if (r->finished()) {
      MOAT_CHECK(r->block_table.empty(), "finished request {} holds blocks", id);
      continue;
    }
    for (int32_t b : r->block_table) ++held[b];
    MOAT_CHECK(r->num_computed_tokens <= static_cast<int64_t>(r->block_table.size()) * config_.block_size,
               "request {} computed {} tokens beyond its {} blocks", id, r->num_computed_tokens, r->block_table.size());
  }
  for (int32_t b = 0; b < pool_.num_blocks(); ++b)
    MOAT_CHECK(held[b] == pool_.refcount(b), "block {}: refcount {} but {} block tables hold it", b,
               pool_.refcount(b), held[b]);
}

}  // namespace moat
