#include "bench/workload.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

namespace moat::bench {

namespace {

// Common English words that GPT-2, Llama 3, Qwen and DeepSeek BPEs each encode as a single token
// when preceded by a space; picking them at random keeps the model from caching a pattern.
constexpr const char* kWords[] = {
    "the",   "of",    "and",   "to",    "in",    "is",    "that",  "for",   "it",    "as",
    "was",   "with",  "be",    "by",    "on",    "not",   "he",    "this",  "are",   "or",
    "his",   "from",  "at",    "which", "but",   "have",  "an",    "had",   "they",  "you",
    "were",  "their", "one",   "all",   "we",    "can",   "her",   "has",   "there", "been",
    "if",    "more",  "when",  "will",  "would", "who",   "so",    "no",    "time",  "people",
    "year",  "way",   "day",   "man",   "thing", "woman", "life",  "child", "world", "school",
    "state", "family", "group", "country", "problem", "hand", "part", "place", "case", "week",
    "company", "system", "program", "question", "work", "number", "night", "point", "home",
    "water", "room",  "mother", "area",  "money", "story", "fact",  "month", "lot",   "right",
    "study", "book",  "eye",   "job",   "word",  "business", "issue", "side", "kind",  "head",
    "house", "service", "friend", "father", "power", "hour", "game", "line", "end",  "city"};
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

int64_t draw(std::mt19937_64& rng, int64_t len, double range_ratio) {
  int64_t lo = std::max<int64_t>(1, static_cast<int64_t>(std::floor(len * range_ratio)));
  if (lo >= len) return std::max<int64_t>(len, 1);
  return std::uniform_int_distribution<int64_t>(lo, len)(rng);
}

}  // namespace

std::vector<LengthPair> sample_lengths(int n, int64_t input_len, int64_t output_len,
                                       double range_ratio, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<LengthPair> lengths(n);
  for (auto& l : lengths) l.input = draw(rng, input_len, range_ratio);
  for (auto& l : lengths) l.output = draw(rng, output_len, range_ratio);
  return lengths;
}

int64_t words_for_tokens(int64_t tokens, double tokens_per_word) {
  if (!(tokens_per_word > 0)) return std::max<int64_t>(1, tokens);
  return std::max<int64_t>(1, std::llround(static_cast<double>(tokens) / tokens_per_word));
}

std::vector<BenchRequest> approximate_prompts(const std::vector<LengthPair>& lengths,
                                              uint64_t seed, double tokens_per_word) {
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
  std::vector<BenchRequest> out;
  out.reserve(lengths.size());
  for (const LengthPair& l : lengths) {
    BenchRequest r;
    const int64_t words = words_for_tokens(l.input, tokens_per_word);
    // What the server's tokenizer makes of them, as calibrated; its usage replaces this.
    r.input_tokens = tokens_per_word > 0
                         ? std::llround(static_cast<double>(words) * tokens_per_word)
                         : l.input;
    r.output_tokens = l.output;
    for (int64_t i = 0; i < words; ++i) {
      if (i) r.prompt += ' ';
      r.prompt += kWords[pick(rng)];
    }
    out.push_back(std::move(r));
  }
  return out;
}

int64_t approximate_token_count(const std::string& text) {
  return std::max<int64_t>(1, static_cast<int64_t>((text.size() + 3) / 4));
}

Result<std::vector<BenchRequest>> load_jsonl_prompts(const std::string& path, int n,
                                                     int64_t default_output_len, int offset) {
  std::ifstream in(path);
  if (!in) return make_error("--dataset {}: cannot open the file", path);
  std::vector<BenchRequest> all;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return make_error("--dataset {}:{}: expected one JSON object per line", path, line_no);
    BenchRequest r;
    if (j.contains("prompt") && j["prompt"].is_string()) {
      r.prompt = j["prompt"].get<std::string>();
    } else if (j.contains("text") && j["text"].is_string()) {
      r.prompt = j["text"].get<std::string>();
    } else {
      return make_error("--dataset {}:{}: expected a string field \"prompt\" (or \"text\")", path,
                        line_no);
    }
    r.output_tokens = default_output_len;
    for (const char* key : {"output_len", "max_tokens"}) {
      if (j.contains(key)) {
        if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
          return make_error("--dataset {}:{}: \"{}\" must be a positive integer", path, line_no,
                            key);
        r.output_tokens = j[key].get<int64_t>();
      }
    }
    r.input_tokens = approximate_token_count(r.prompt);
    all.push_back(std::move(r));
  }
  if (all.empty()) return make_error("--dataset {}: no prompts in the file", path);
  std::vector<BenchRequest> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.push_back(all[(offset + i) % all.size()]);
  return out;
}

Result<std::vector<BenchRequest>> build_workload(const WorkloadSpec& spec, int n, uint64_t seed,
                                                 int offset) {
  if (!spec.dataset_path.empty()) {
    MOAT_ASSIGN_OR_RETURN(auto requests,
                          load_jsonl_prompts(spec.dataset_path, n, spec.output_len, offset));
    if (!spec.tokenizer_dir.empty()) {
      std::vector<std::string> texts;
      for (const auto& r : requests) texts.push_back(r.prompt);
      MOAT_ASSIGN_OR_RETURN(auto counts, count_tokens(spec.tokenizer_dir, texts));
      for (size_t i = 0; i < requests.size(); ++i) requests[i].input_tokens = counts[i];
    }
    return requests;
  }
  if (spec.input_len <= 0) return make_error("--input-len must be positive, got {}", spec.input_len);
  if (spec.output_len <= 0)
    return make_error("--output-len must be positive, got {}", spec.output_len);
  if (spec.range_ratio < 0 || spec.range_ratio > 1)
    return make_error("--range-ratio must be in [0, 1], got {}", spec.range_ratio);
  auto lengths = sample_lengths(n, spec.input_len, spec.output_len, spec.range_ratio, seed);
  if (!spec.tokenizer_dir.empty()) return tokenizer_prompts(spec.tokenizer_dir, lengths, seed);
  return approximate_prompts(lengths, seed, spec.tokens_per_word);
}

}  // namespace moat::bench
