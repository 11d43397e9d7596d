#include "spec/ngram_proposer.h"

#include <algorithm>

namespace moat {

std::vector<int32_t> NgramProposer::lookup(std::span<const int32_t> tokens, int32_t min_n, int32_t max_n,
                                           int32_t max_tokens) {
  const int64_t L = static_cast<int64_t>(tokens.size());
  for (int64_t n = std::min<int64_t>(max_n, L - 1); n >= min_n; --n) {
    const std::span<const int32_t> suffix = tokens.subspan(static_cast<size_t>(L - n));
    // most recent earlier occurrence first: recent context predicts best
    for (int64_t start = L - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const int64_t from = start + n, count = std::min<int64_t>(max_tokens, L - from);
      return {tokens.begin() + from, tokens.begin() + from + count};
    }
  }
  return {};
}

void NgramProposer::propose(std::span<const ProposeRequest> requests) {
  for (const ProposeRequest& pr : requests) {
    Request& r = *pr.request;
    context_.assign(r.prompt.begin(), r.prompt.end());
    context_.insert(context_.end(), r.output.begin(), r.output.end());
    r.spec_tokens = lookup(context_, min_n_, max_n_, pr.max_tokens);
    r.spec_probs.clear();
  }
}

}  // namespace moat
