// A proposer that knows each request's greedy output and guesses it with one wrong token, at
// every position in turn (and all right every k + 1 calls): speculative decoding must accept,
// reject and roll back at each position and still give the plain greedy output. Shared by the
// engine tests and the tensor-parallel tests.
#pragma once

#include <map>
#include <span>
#include <string_view>
#include <vector>

#include "spec/proposer.h"

namespace moat::testing {

class WrongInTurnProposer final : public Proposer {
 public:
  WrongInTurnProposer(std::map<uint64_t, std::vector<int32_t>> truth, int32_t vocab) : truth_(std::move(truth)), vocab_(vocab) {}
  std::string_view name() const override { return "wrong-in-turn"; }
  void propose(std::span<const ProposeRequest> requests) override {
    for (const ProposeRequest& pr : requests) {
      Request& r = *pr.request;
      const std::vector<int32_t>& t = truth_.at(r.id);
      const size_t from = r.output.size();
      const int32_t wrong_at = calls_++ % (pr.max_tokens + 1);  // max_tokens: all right
      for (int32_t j = 0; j < pr.max_tokens && from + j < t.size(); ++j)
        r.spec_tokens.push_back(j == wrong_at ? (t[from + j] + 1) % vocab_ : t[from + j]);
    }
  }
  void release(uint64_t) override {}

 private:
  std::map<uint64_t, std::vector<int32_t>> truth_;
  int32_t vocab_;
  int32_t calls_ = 0;
};

}  // namespace moat::testing
