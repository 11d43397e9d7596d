// Prompt lookup (n-gram) proposals: no model. The last n tokens of the request (n from max_n down
// to min_n) are searched for earlier in its own prompt and output; the tokens that followed the
// most recent earlier occurrence are the guess. Pays off where outputs copy their context (code
// edits, summaries, quoting, retrieval answers), costs one scan of the context otherwise.
#pragma once

#include "spec/proposer.h"

namespace moat {

class NgramProposer final : public Proposer {
 public:
  // 1 <= min_n <= max_n
  NgramProposer(int32_t min_n, int32_t max_n) : min_n_(min_n), max_n_(max_n) {}
  std::string_view name() const override { return "ngram"; }
  void propose(std::span<const ProposeRequest> requests) override;

  // The guess for one token sequence: up to max_tokens tokens, empty when no n-gram recurs.
  static std::vector<int32_t> lookup(std::span<const int32_t> tokens, int32_t min_n, int32_t max_n,
                                     int32_t max_tokens);

 private:
  int32_t min_n_, max_n_;
  std::vector<int32_t> context_;
};

}  // namespace moat
