// Speculative decoding: proposers guess the next tokens of decoding requests; the engine verifies
// every guess in the next target step (one forward over the last token and the guesses, logits
// for each) and keeps the longest prefix that rejection sampling accepts, plus one token of its
// own. The proposal lives on the request (Request::spec_tokens / spec_probs), so the scheduler,
// the batch builder and the verifier need nothing from the proposer.
//
// A proposer is a plain object owned by the engine and driven from its one thread: propose() at
// the end of a step for the requests that decode next, release() when a request is gone.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "sched/scheduler.h"

namespace moat {

struct ProposeRequest {
  Request* request;
  int32_t max_tokens;  // >= 1; the proposer may guess fewer (or none)
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual std::string_view name() const = 0;
  // Sets each request's spec_tokens (at most max_tokens) and, when it sampled them from a
  // distribution other than one-hot, spec_probs [spec_tokens.size(), vocab]. Requests arrive
  // with empty proposals and are in decode state (every token but the last computed).
  virtual void propose(std::span<const ProposeRequest> requests) = 0;
  // The request finished (or was aborted): drop what the proposer keeps for it.
  virtual void release(uint64_t /*request_id*/) {}
  // Proposers that read the target's hidden states (MTP) see every target step before propose():
  // the step the scheduler ran, after its update (num_computed_tokens says which rows were
  // accepted), and the target's final normed hidden state of each of its rows [T, hidden].
  virtual bool wants_target_hidden() const { return false; }
  virtual void observe_target_step(const SchedulerOutput& /*step*/, std::span<const float> /*hidden*/) {}
};

}  // namespace moat
