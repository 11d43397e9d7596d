#include "spec/draft_proposer.h"

#include <algorithm>

namespace moat {

Result<std::unique_ptr<DraftModelProposer>> DraftModelProposer::create(DeepseekModel& draft, int64_t target_vocab,
                                                                       int32_t max_num_seqs, int64_t max_model_len,
                                                                       int32_t block_size) {
  if (draft.config().vocab_size != target_vocab)
    return make_error("the draft model's vocabulary ({} tokens) differs from the target's ({}): a draft must share "
                      "the target's tokenizer",
                      draft.config().vocab_size, target_vocab);
  if (draft.max_context() < max_model_len)
    return make_error("the draft model was loaded for {} tokens of context, the target serves {}", draft.max_context(),
                      max_model_len);
  const int64_t blocks_per_seq = (max_model_len + block_size - 1) / block_size;
  const int64_t num_blocks = blocks_per_seq * max_num_seqs;
  if (num_blocks > INT32_MAX) return make_error("draft cache of {} blocks is more than block ids can name", num_blocks);
  return std::unique_ptr<DraftModelProposer>(
      new DraftModelProposer(draft, static_cast<int32_t>(num_blocks), block_size, max_num_seqs));
}

DraftModelProposer::DraftModelProposer(DeepseekModel& draft, int32_t num_blocks, int32_t block_size,
                                       int32_t max_num_seqs)
    : model_(draft),
      cache_(draft.cache_shape(), num_blocks, block_size),
      pool_(num_blocks, block_size),
      guesses_(draft.ops()),
      state_pool_(draft.state_bytes_per_request() > 0 ? max_num_seqs : 0, draft.state_bytes_per_request()) {}

void DraftModelProposer::release(uint64_t request_id) {
  auto it = states_.find(request_id);
  if (it == states_.end()) return;
  for (int32_t b : it->second.blocks) pool_.release(b);
  if (it->second.slot >= 0) state_pool_.release(it->second.slot);
  states_.erase(it);
}

void DraftModelProposer::rewind(State& s, int64_t trusted) {
  if (trusted >= s.valid) return;
  if (s.slot >= 0) {
    const int64_t bytes = state_pool_.bytes_per_slot();
    auto snap = std::find_if(s.snapshots.begin(), s.snapshots.end(), [&](const auto& e) { return e.first == trusted; });
    if (snap != s.snapshots.end()) {
      std::copy_n(snap->second.data(), bytes, state_pool_.data(s.slot));
    } else {  // no copy of the state there (a preempted request starts over): recompute from 0
      std::fill_n(state_pool_.data(s.slot), bytes, uint8_t{0});
      trusted = 0;
    }
  }
  s.valid = trusted;
}

void DraftModelProposer::propose(std::span<const ProposeRequest> requests) {
  const int64_t V = model_.config().vocab_size;
  const int32_t bs = pool_.block_size();
  // Requests whose draft state has room for their whole guess, longest guess first, so step j
  // drafts for a prefix of them.
  std::vector<const ProposeRequest*> order;
  for (const ProposeRequest& pr : requests) {
    Request& r = *pr.request;
    r.spec_tokens.clear();
    r.spec_probs.clear();
    State& s = states_[r.id];
    if (state_pool_.enabled() && s.slot < 0) {
      const std::optional<int32_t> slot = state_pool_.allocate();
      if (!slot) continue;  // every draft state slot in use: no guess this time
      s.slot = *slot;
      s.valid = 0;
    }
    rewind(s, r.num_computed_tokens);
    s.snapshots.clear();
    // rows for every token and all but the last draft (the last is never fed back)
    if (!pool_.extend(s.blocks, r.length() + pr.max_tokens - 1)) continue;  // draft cache full: no guess this time
    order.push_back(&pr);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const ProposeRequest* a, const ProposeRequest* b) { return a->max_tokens > b->max_tokens; });
  std::vector<Request*> active;
  for (const ProposeRequest* pr : order) active.push_back(pr->request);
  guesses_.begin(active);

  // Long catch-ups (a new request's prompt) run first in chunks without logits, so one draft
  // forward never holds the activations of a whole long prompt.
  constexpr int64_t kCatchUpChunk = 512;
  std::vector<int32_t> chunk;
  for (Request* r : active) {
    State& s = states_[r->id];
    while (r->length() - s.valid > kCatchUpChunk) {
      chunk.clear();
      for (int64_t p = s.valid; p < s.valid + kCatchUpChunk; ++p) chunk.push_back(r->token_at(p));
      ForwardBatch batch;
      batch.block_size = bs;
      batch.add_sequence(chunk, static_cast<int32_t>(s.valid), s.blocks, ForwardBatch::Logits::none, s.slot);
      model_.forward(batch, cache_, nullptr, nullptr, {.states = &state_pool_});
      s.valid += kCatchUpChunk;
    }
  }
  for (int32_t j = 0; !order.empty(); ++j) {
    while (!order.empty() && order.back()->max_tokens <= j) order.pop_back();
    if (order.empty()) break;
    ForwardBatch batch;
    batch.block_size = bs;
    for (const ProposeRequest* pr : order) {
      Request& r = *pr->request;
      State& s = states_[r.id];
      const int64_t L = r.length();
      if (j == 0) {  // catch up to and including the last token
        chunk.clear();
        for (int64_t p = s.valid; p < L; ++p) chunk.push_back(r.token_at(p));
        batch.add_sequence(chunk, static_cast<int32_t>(s.valid), s.blocks, ForwardBatch::Logits::last, s.slot);
        s.valid = L;
      } else {  // feed draft j - 1
        const int32_t t = r.spec_tokens[static_cast<size_t>(j - 1)];
        batch.add_sequence({&t, 1}, static_cast<int32_t>(L + j - 1), s.blocks, ForwardBatch::Logits::last, s.slot);
        s.valid = L + j;
      }
    }
    const int64_t rows = static_cast<int64_t>(order.size());
    logits_.resize(static_cast<size_t>(rows * V));
    model_.forward(batch, cache_, logits_.data(), nullptr, {.states = &state_pool_});
    guesses_.draw(logits_.data(), rows, V);
    if (state_pool_.enabled())  // the state after this step, for the position the target may stop at
      for (const ProposeRequest* pr : order) {
        State& s = states_[pr->request->id];
        const uint8_t* state = state_pool_.data(s.slot);
        s.snapshots.emplace_back(s.valid, std::vector<uint8_t>(state, state + state_pool_.bytes_per_slot()));
      }
  }
}

}  // namespace moat
