// Sizing word prompts on the server's own tokenizer when no --tokenizer is given.
//
// Without a tokenizer, prompts are common English words, one token each on GPT-2/Llama-style
// vocabularies but not on every server's: "128 tokens" of them were 365 on one. So the server
// counts two such prompts of different lengths, by POST /tokenize (llama-server, vLLM: no
// generation) or else by usage.prompt_tokens of a one-token request, and the slope between the
// two is its tokens per word. Two points, not one, so that what the server adds to every
// request (BOS, a chat template) is not mistaken for words.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "bench/client.h"
#include "bench/workload.h"

namespace moat::bench {

struct PromptCalibration {
  double tokens_per_word = 0;  // of the word prompts, on the server's tokenizer
  double added_tokens = 0;     // per request beyond the text (BOS, chat template); 0 via /tokenize
  std::string method;          // "POST /tokenize" or "usage.prompt_tokens"
  int64_t words[2] = {0, 0};
  int64_t tokens[2] = {0, 0};  // what the server counted for each
};

// Two words prompts counted by the server (see above). Errors name what the server lacked.
Result<PromptCalibration> calibrate_word_prompts(const EndpointConfig& endpoint, uint64_t seed);

// One line for the log: what was measured and what the prompts become.
std::string describe(const PromptCalibration& c, int64_t input_len);

}  // namespace moat::bench
