#include "spec/mtp_proposer.h"

#include <algorithm>
#include <cstring>

namespace moat {

Result<std::unique_ptr<MtpProposer>> MtpProposer::create(DeepseekModel& mtp, int64_t target_vocab, int64_t target_hidden,
                                                         int32_t target_blocks, int32_t block_size, int32_t max_num_seqs,
                                                         int32_t max_guesses) {
  if (!mtp.is_mtp()) return make_error("the MTP proposer needs a model loaded as an MTP head");
  if (mtp.config().vocab_size != target_vocab || mtp.config().hidden_size != target_hidden)
    return make_error("MTP head of vocabulary {} / hidden {} for a target of {} / {}", mtp.config().vocab_size,
                      mtp.config().hidden_size, target_vocab, target_hidden);
  // chained guesses reach max_guesses - 1 rows past the last computed one
  const int32_t scratch = (max_guesses + block_size - 1) / block_size + 1;
  const int64_t blocks = static_cast<int64_t>(target_blocks) + static_cast<int64_t>(scratch) * max_num_seqs;
  if (blocks > INT32_MAX) return make_error("MTP cache of {} blocks is more than block ids can name", blocks);
  return std::unique_ptr<MtpProposer>(new MtpProposer(mtp, target_blocks, block_size, scratch, max_num_seqs));
}

MtpProposer::MtpProposer(DeepseekModel& mtp, int32_t target_blocks, int32_t block_size, int32_t scratch_per_seq,
                         int32_t max_num_seqs)
    : mtp_(mtp),
      target_blocks_(target_blocks),
      scratch_per_seq_(scratch_per_seq),
      cache_(mtp.cache_shape(), target_blocks + scratch_per_seq * max_num_seqs, block_size),
      guesses_(mtp.ops()) {}

void MtpProposer::observe_target_step(const SchedulerOutput& step, std::span<const float> hidden) {
  const int64_t H = mtp_.config().hidden_size, V = mtp_.config().vocab_size;
  ForwardBatch batch;
  batch.block_size = cache_.block_size();
  std::vector<Request*> wants_first;  // requests whose last row's logits start the next proposal
  std::vector<int32_t> tokens;
  prev_.clear();
  int64_t row0 = 0;  // the chunk's first row in the target step
  for (const ScheduledChunk& c : step.chunks) {
    Request& r = *c.request;
    const int64_t end = std::min(c.first + c.num_tokens, r.num_computed_tokens);  // rows kept
    if (!r.finished() && end > c.first) {
      // row p pairs h_p with the token after it, known for every kept row
      tokens.clear();
      for (int64_t p = c.first; p < end; ++p) tokens.push_back(r.token_at(p + 1));
      const bool decoding = r.num_computed_tokens == r.length() - 1 && end == r.num_computed_tokens;
      batch.add_sequence(tokens, static_cast<int32_t>(c.first), r.block_table,
                         decoding ? ForwardBatch::Logits::last : ForwardBatch::Logits::none);
      prev_.insert(prev_.end(), hidden.begin() + row0 * H, hidden.begin() + (row0 + end - c.first) * H);
      if (decoding) wants_first.push_back(&r);
    }
    row0 += c.num_tokens;
  }
  MOAT_CHECK(row0 * H == static_cast<int64_t>(hidden.size()), "{} hidden rows for a step of {}", hidden.size() / H, row0);
  if (batch.num_tokens() == 0) return;
  const int64_t T = batch.num_tokens();
  state_.resize(static_cast<size_t>(T * H));
  logits_.resize(static_cast<size_t>(wants_first.size() * V));
  mtp_.forward(batch, cache_, logits_.data(), nullptr, {.mtp_prev_hidden = prev_.data(), .residual = state_.data()});
  for (size_t i = 0; i < wants_first.size(); ++i) {
    const int32_t row = batch.logit_rows[i];
    First& f = first_[wants_first[i]->id];
    f.position = batch.positions[row];
    f.logits.assign(logits_.begin() + static_cast<int64_t>(i) * V, logits_.begin() + static_cast<int64_t>(i + 1) * V);
    f.state.assign(state_.begin() + row * H, state_.begin() + (row + 1) * H);
  }
}

void MtpProposer::propose(std::span<const ProposeRequest> requests) {
  const int64_t H = mtp_.config().hidden_size, V = mtp_.config().vocab_size;
  const int32_t bs = cache_.block_size();
  // Requests with a first guess ready, longest proposal first (step j runs a prefix of them).
  std::vector<const ProposeRequest*> order;
  for (const ProposeRequest& pr : requests) {
    pr.request->spec_tokens.clear();
    pr.request->spec_probs.clear();
    auto it = first_.find(pr.request->id);
    if (it != first_.end() && it->second.position == pr.request->num_computed_tokens - 1) order.push_back(&pr);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const ProposeRequest* a, const ProposeRequest* b) { return a->max_tokens > b->max_tokens; });
  MOAT_CHECK(static_cast<int64_t>(order.size()) * scratch_per_seq_ + target_blocks_ <= cache_.num_blocks(),
             "{} requests propose at once, more than the MTP scratch blocks allow", order.size());
  std::vector<Request*> active;
  for (const ProposeRequest* pr : order) active.push_back(pr->request);
  guesses_.begin(active);
  // guess 0: from the logits the target step left
  logits_.resize(active.size() * static_cast<size_t>(V));
  prev_.resize(active.size() * static_cast<size_t>(H));
  for (size_t i = 0; i < active.size(); ++i) {
    const First& f = first_.at(active[i]->id);
    std::copy(f.logits.begin(), f.logits.end(), logits_.begin() + static_cast<int64_t>(i) * V);
    std::copy(f.state.begin(), f.state.end(), prev_.begin() + static_cast<int64_t>(i) * H);
  }
  if (!active.empty()) guesses_.draw(logits_.data(), static_cast<int64_t>(active.size()), V);
  for (int32_t j = 1; !order.empty(); ++j) {
    while (!order.empty() && order.back()->max_tokens <= j) order.pop_back();
    if (order.empty()) break;
    const int64_t rows = static_cast<int64_t>(order.size());
    ForwardBatch batch;
    batch.block_size = bs;
    for (int64_t i = 0; i < rows; ++i) {
      Request& r = *active[i];
      const int64_t position = first_.at(r.id).position + j;
      // the request's blocks, then scratch blocks of its own for rows past them
      table_.assign(r.block_table.begin(), r.block_table.end());
      for (int32_t s = 0; static_cast<int64_t>(table_.size()) * bs <= position; ++s) {
        MOAT_CHECK(s < scratch_per_seq_, "guess row {} beyond the scratch blocks", position);
        table_.push_back(target_blocks_ + static_cast<int32_t>(i) * scratch_per_seq_ + s);
      }
      const int32_t t = r.spec_tokens[static_cast<size_t>(j - 1)];
      batch.add_sequence({&t, 1}, static_cast<int32_t>(position), table_, ForwardBatch::Logits::last);
    }
    state_.resize(static_cast<size_t>(rows * H));
    logits_.resize(static_cast<size_t>(rows * V));
    mtp_.forward(batch, cache_, logits_.data(), nullptr, {.mtp_prev_hidden = prev_.data(), .residual = state_.data()});
    std::copy(state_.begin(), state_.end(), prev_.begin());
    guesses_.draw(logits_.data(), rows, V);
  }
  first_.clear();  // the next step's observation brings new ones
}

}  // namespace moat
