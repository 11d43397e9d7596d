#include "sample/sampler.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"

namespace moat {

namespace {
constexpr int32_t kMaxTopLogprobs = 20;  // OpenAI's and vLLM's default limit
constexpr float kMaxLogitBias = 100.0f;  // OpenAI: -100 bans a token, 100 forces it

// Indices of the n largest of row[0, vocab), largest first, lower id first on ties. n is at most
// 20: insertion into a short sorted list, one compare per entry for nearly all of the vocabulary.
void top_n(const float* row, int64_t vocab, int64_t n, std::vector<int32_t>& idx) {
  n = std::min(n, vocab);
  idx.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = row[i];
    if (static_cast<int64_t>(idx.size()) == n) {
      if (!(x > row[idx.back()])) continue;
      idx.pop_back();
    }
    auto pos = idx.end();
    while (pos != idx.begin() && x > row[*(pos - 1)]) --pos;
    idx.insert(pos, static_cast<int32_t>(i));
  }
}
}  // namespace

Status SamplingParams::validate(int64_t vocab_size) const {
  if (!(std::isfinite(temperature) && temperature >= 0.0f))
    return make_error("temperature must be >= 0 (0: greedy), got {}", temperature);
  if (top_k < -1) return make_error("top_k must be -1, 0 (disabled) or positive, got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) return make_error("top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return make_error("min_p must be in [0, 1], got {}", min_p);
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return make_error("presence_penalty must be in [-2, 2], got {}", presence_penalty);
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    return make_error("frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f))
    return make_error("repetition_penalty must be > 0 (1: off), got {}", repetition_penalty);
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs)
    return make_error("top_logprobs must be in [0, {}], got {}", kMaxTopLogprobs, top_logprobs);
  std::vector<int32_t> ids;
  ids.reserve(logit_bias.size());
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      if (vocab_size > 0) return make_error("logit_bias: token id {} outside the vocabulary of {}", id, vocab_size);
      return make_error("logit_bias: token id {} must be >= 0", id);
    }
    if (!(bias >= -kMaxLogitBias && bias <= kMaxLogitBias))
      return make_error("logit_bias: the bias of token id {} must be in [-100, 100], got {}", id, bias);
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  if (auto dup = std::adjacent_find(ids.begin(), ids.end()); dup != ids.end())
    return make_error("logit_bias: token id {} given more than once", *dup);
  return ok_status();
}

void Sampler::apply_bias_and_penalties(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows) {
  for (int64_t r = 0; r < R; ++r) {
    const SamplingParams& sp = *rows[r].params;
    float* row = logits + r * vocab;
    for (const auto& [id, bias] : sp.logit_bias) {
      MOAT_CHECK(id >= 0 && id < vocab, "logit_bias id {} outside the vocabulary of {} (not validated?)", id, vocab);
      row[id] += bias;
    }
    if (!sp.has_penalties()) continue;
    if (static_cast<int64_t>(seen_.size()) != vocab) {  // once per vocabulary, never per step
      seen_.assign(static_cast<size_t>(vocab), 0);
      counts_.assign(static_cast<size_t>(vocab), 0);
      stamp_ = 0;
    }
    auto check_id = [&](int32_t t) { MOAT_CHECK(t >= 0 && t < vocab, "token id {} outside the vocabulary of {}", t, vocab); };
    if (sp.repetition_penalty != 1.0f) {
      // Each distinct token once: seen_[t] == stamp_ marks the ones already penalized in this row.
      if (++stamp_ == 0) {
        std::fill(seen_.begin(), seen_.end(), 0u);
        stamp_ = 1;
      }
      const float rp = sp.repetition_penalty;
      for (std::span<const int32_t> tokens : {rows[r].prompt_tokens, rows[r].output_tokens})
        for (int32_t t : tokens) {
          check_id(t);
          if (seen_[t] == stamp_) continue;
          seen_[t] = stamp_;
          row[t] = row[t] > 0.0f ? row[t] / rp : row[t] * rp;
        }
    }
    if (sp.frequency_penalty != 0.0f || sp.presence_penalty != 0.0f) {
      for (int32_t t : rows[r].output_tokens) {
        check_id(t);
        ++counts_[t];
      }
      // Two subtractions, as vLLM's `logits -= f * counts; logits -= p * (counts > 0)`; the count
      // is zeroed as it is used, so each token is penalized once and counts_ is clean for the next row.
      for (int32_t t : rows[r].output_tokens) {
        if (counts_[t] == 0) continue;
        row[t] -= sp.frequency_penalty * static_cast<float>(counts_[t]);
        row[t] -= sp.presence_penalty;
        counts_[t] = 0;
      }
    }
  }
}

void Sampler::fill_logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                            std::span<SampledToken> out) {
  row_max_.assign(static_cast<size_t>(R), NAN);
  log_sum_.assign(static_cast<size_t>(R), NAN);
  for (int64_t r = 0; r < R; ++r) {
    const SamplingParams& sp = *rows[r].params;
    out[r].top_logprobs.clear();
    if (!sp.wants_logprobs()) continue;
    const float* row = logits + r * vocab;
    top_n(row, vocab, std::max(sp.top_logprobs, 1), top_);
    // log_softmax(l)_i = l_i - max - log(sum exp(l - max)). The softmax op gives 1 / sum at the
    // argmax (exp(0) = 1), so the log of the sum costs no second exp pass here, and l_i - max is
    // exact for tokens whose probability underflows fp32.
    row_.resize(static_cast<size_t>(vocab));
    ops_->softmax(row, 1, vocab, 1.0f, row_.data());
    row_max_[r] = row[top_[0]];
    log_sum_[r] = -std::log(row_[top_[0]]);
    for (int32_t i = 0; i < sp.top_logprobs && i < static_cast<int32_t>(top_.size()); ++i)
      out[r].top_logprobs.emplace_back(top_[i], (row[top_[i]] - row_max_[r]) - log_sum_[r]);
  }
}

void Sampler::distributions(const float* logits, int64_t vocab, std::span<const SamplingRow> rows,
                            std::span<const int64_t> which, float* probs) {
  const int64_t S = static_cast<int64_t>(which.size());
  k_.resize(S);
  p_.resize(S);
  min_p_.resize(S);
  bool any_k = false, any_p = false, any_min_p = false;
  for (int64_t s = 0; s < S;) {
    const SamplingParams& sp = *rows[which[s]].params;
    const float* row = logits + which[s] * vocab;
    if (sp.greedy()) {  // one-hot at the argmax: what sample() picks for this row
      int32_t token = 0;
      ops_->argmax(row, 1, vocab, &token);
      std::fill(probs + s * vocab, probs + (s + 1) * vocab, 0.0f);
      probs[s * vocab + token] = 1.0f;
      k_[s] = 0, p_[s] = 1.0f, min_p_[s] = 0.0f;
      ++s;
      continue;
    }
    // One softmax call for each run of rows adjacent in logits with the same temperature (the
    // op takes one temperature): one call for a batch of uniform requests.
    int64_t e = s + 1;
    while (e < S && which[e] == which[e - 1] + 1 && !rows[which[e]].params->greedy() &&
           rows[which[e]].params->temperature == sp.temperature)
      ++e;
    ops_->softmax(row, e - s, vocab, sp.temperature, probs + s * vocab);
    for (; s < e; ++s) {
      const SamplingParams& q = *rows[which[s]].params;
      k_[s] = q.top_k > 0 && q.top_k < vocab ? q.top_k : 0;
      p_[s] = q.top_p;
      min_p_[s] = q.min_p;
      any_k |= k_[s] > 0;
      any_p |= q.top_p < 1.0f;
      any_min_p |= q.min_p > 0.0f;
    }
  }
  if (any_k) ops_->top_k_renorm_prob(probs, S, vocab, k_.data());
  if (any_p) ops_->top_p_renorm_prob(probs, S, vocab, p_.data());
  if (any_min_p) ops_->min_p_renorm_prob(probs, S, vocab, min_p_.data());
}

void Sampler::sample(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                     std::span<SampledToken> out) {
  MOAT_CHECK(static_cast<int64_t>(rows.size()) == R && static_cast<int64_t>(out.size()) == R,
             "{} logit rows, {} sampling rows, {} outputs", R, rows.size(), out.size());
  for (const SamplingRow& row : rows) {
    MOAT_CHECK(row.params != nullptr, "a sampling row without parameters");
    MOAT_CHECK(row.params->greedy() || row.rng != nullptr, "a sampling row without a generator");
  }
  apply_bias_and_penalties(logits, R, vocab, rows);
  fill_logprobs(logits, R, vocab, rows, out);

  which_.clear();
  for (int64_t r = 0; r < R;) {
    if (!rows[r].params->greedy()) {
      which_.push_back(r++);
      continue;
    }
    int64_t e = r + 1;  // one argmax call per run of adjacent greedy rows
    while (e < R && rows[e].params->greedy()) ++e;
    tokens_.resize(e - r);
    ops_->argmax(logits + r * vocab, e - r, vocab, tokens_.data());
    for (int64_t i = r; i < e; ++i) out[i].token = tokens_[i - r];
    r = e;
  }
  if (!which_.empty()) {
    const int64_t S = static_cast<int64_t>(which_.size());
    probs_.resize(static_cast<size_t>(S * vocab));
    distributions(logits, vocab, rows, which_, probs_.data());
    u_.resize(S);
    for (int64_t s = 0; s < S; ++s) u_[s] = std::uniform_real_distribution<float>(0.0f, 1.0f)(*rows[which_[s]].rng);
    tokens_.resize(S);
    ops_->sample_from_probs(probs_.data(), S, vocab, u_.data(), tokens_.data());
    for (int64_t s = 0; s < S; ++s) out[which_[s]].token = tokens_[s];
  }
  chosen_logprobs(logits, R, vocab, rows, out);
}

void Sampler::chosen_logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                              std::span<SampledToken> out) const {
  for (int64_t r = 0; r < R; ++r)
    out[r].logprob = rows[r].params->wants_logprobs() ? (logits[r * vocab + out[r].token] - row_max_[r]) - log_sum_[r] : NAN;
}

void Sampler::probabilities(float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                            float* probs) {
  MOAT_CHECK(static_cast<int64_t>(rows.size()) == R, "{} logit rows, {} sampling rows", R, rows.size());
  apply_bias_and_penalties(logits, R, vocab, rows);
  which_.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) which_[r] = r;
  distributions(logits, vocab, rows, which_, probs);
}

void Sampler::logprobs(const float* logits, int64_t R, int64_t vocab, std::span<const SamplingRow> rows,
                       std::span<const int32_t> tokens, std::span<SampledToken> out) {
  MOAT_CHECK(static_cast<int64_t>(rows.size()) >= R && static_cast<int64_t>(tokens.size()) >= R &&
                 static_cast<int64_t>(out.size()) >= R,
             "{} logit rows, {} sampling rows, {} tokens, {} outputs", R, rows.size(), tokens.size(), out.size());
  fill_logprobs(logits, R, vocab, rows, out);
  for (int64_t r = 0; r < R; ++r) out[r].token = tokens[r];
  chosen_logprobs(logits, R, vocab, rows, out);
}

float* Sampler::writable_row(const float* logits, int64_t vocab, const SamplingParams& params) {
  // Without a token history only logit_bias writes into the row; with none, nothing does.
  if (params.logit_bias.empty()) return const_cast<float*>(logits);
  one_row_.assign(logits, logits + vocab);
  return one_row_.data();
}

int32_t Sampler::sample(const float* logits, int64_t vocab, const SamplingParams& params, std::mt19937_64& rng) {
  const SamplingRow row{.params = &params, .rng = &rng};
  SampledToken out;
  sample(writable_row(logits, vocab, params), 1, vocab, {&row, 1}, {&out, 1});
  return out.token;
}

void Sampler::probabilities(const float* logits, int64_t vocab, const SamplingParams& params, float* probs) {
  const SamplingRow row{.params = &params};
  probabilities(writable_row(logits, vocab, params), 1, vocab, {&row, 1}, probs);
}

}  // namespace moat
