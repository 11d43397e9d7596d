// Steps an engine until every request finishes, collecting each request's outputs and checking
// the scheduler's invariants after every step and an empty block pool at the end (shared by the
// engine tests).
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace moat::testing {

struct Finished {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // one per token, for requests that asked
  std::string text;
  RequestOutput last;           // the output that finished it
};

// A greedy request for token ids, generating exactly max_tokens (eos ignored).
inline GenerateRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  r.stop.ignore_eos = true;
  return r;
}

inline std::map<uint64_t, Finished> run_to_completion(Engine& e) {
  std::map<uint64_t, Finished> done;
  for (int steps = 0; e.has_work(); ++steps) {
    EXPECT_LT(steps, 10000) << "no progress";
    for (RequestOutput& out : e.step()) {
      Finished& f = done[out.id];
      f.tokens.insert(f.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      for (const SampledToken& s : out.logprobs) f.logprobs.push_back(s.logprob);
      f.text += out.text;
      if (out.finished) f.last = out;
    }
    e.scheduler().check_invariants();
  }
  EXPECT_EQ(e.scheduler().block_pool().num_used(), 0) << "blocks still held after every request finished";
  return done;
}

}  // namespace moat::testing
