// What the benchmark sends: prompts with their output lengths.
//
// Random prompts follow sglang bench_serving's "random" dataset: each request's input and output
// lengths are drawn uniformly from [max(1, floor(len * range_ratio)), len], so range_ratio 1 means
// every request has exactly len tokens (our default) and 0 means anything from 1 to len (sglang's
// default). With a tokenizer (a local model dir) prompts are random token ids decoded to text and
// re-encoded until the count is exact; without one, prompts are random common English words that
// each encode to one token (with their leading space) in GPT/Llama-style BPE vocabularies, so the
// count is approximate: typically within a few percent, plus the server's BOS or chat template.
// Other vocabularies split them into more tokens; `moat bench` then measures the server's tokens
// per word (bench/calibrate.h) and builds prompts of len / tokens_per_word words.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/status.h"

namespace moat::bench {

struct BenchRequest {
  std::string prompt;
  int64_t input_tokens = 0;  // exact with a tokenizer, approximate otherwise
  int64_t output_tokens = 0;  // max_tokens sent to the server
};

struct LengthPair {
  int64_t input = 0, output = 0;
};

// Lengths for n requests, sglang-style range ratio, reproducible from the seed.
std::vector<LengthPair> sample_lengths(int n, int64_t input_len, int64_t output_len,
                                       double range_ratio, uint64_t seed);

// Random prompts without a tokenizer (approximate token counts; see the header comment): each
// of len / tokens_per_word words (one word per token when tokens_per_word is 0).
std::vector<BenchRequest> approximate_prompts(const std::vector<LengthPair>& lengths, uint64_t seed,
                                              double tokens_per_word = 0);

// Words for a prompt of `tokens` tokens at tokens_per_word (0: one each); at least one.
int64_t words_for_tokens(int64_t tokens, double tokens_per_word);

// Random prompts with the tokenizer in model_dir (exact token counts). Lives in
// prompts_tokenizer.cpp, the only file that depends on the tokenizer module.
Result<std::vector<BenchRequest>> tokenizer_prompts(const std::string& model_dir,
                                                    const std::vector<LengthPair>& lengths,
                                                    uint64_t seed);

// Counts tokens with the tokenizer in model_dir (for JSONL prompts); error if it cannot load.
Result<std::vector<int64_t>> count_tokens(const std::string& model_dir,
                                          const std::vector<std::string>& texts);

// A JSONL file with one object per line: {"prompt": "..."} (or "text"), optionally with
// "output_len" / "max_tokens". Lines without an output length get default_output_len. n prompts
// are taken from line `offset` on, cycling when the file has fewer.
Result<std::vector<BenchRequest>> load_jsonl_prompts(const std::string& path, int n,
                                                     int64_t default_output_len, int offset = 0);

struct WorkloadSpec {
  int64_t input_len = 1024, output_len = 128;
  double range_ratio = 1.0;
  std::string dataset_path;   // JSONL prompts instead of random ones
  std::string tokenizer_dir;  // exact token counts when set
  double tokens_per_word = 0;  // without a tokenizer: measured on the server; 0 = one per word
};

// n requests from the spec: random prompts drawn from `seed`, or JSONL lines from `offset`.
Result<std::vector<BenchRequest>> build_workload(const WorkloadSpec& spec, int n, uint64_t seed,
                                                 int offset);

// Rough token count for text without a tokenizer: ~4 bytes per token for English BPE.
int64_t approximate_token_count(const std::string& text);

}  // namespace moat::bench
