// The only file of the bench module that touches the tokenizer, so that the rest (and its tests)
// builds while the tokenizer module is absent or changing.
#include "bench/workload.h"

#if __has_include("tokenizer/tokenizer.h")
#include "tokenizer/tokenizer.h"
#define MOAT_BENCH_HAVE_TOKENIZER 1
#endif

#include <algorithm>
#include <random>

namespace moat::bench {

#ifdef MOAT_BENCH_HAVE_TOKENIZER

namespace {

// Random ids decoded to text do not always re-encode to the same count (merges across token
// boundaries), so trim or extend on the re-encoded ids until the text encodes to exactly n tokens.
std::string exact_prompt(const Tokenizer& tok, const std::vector<int32_t>& pool, int64_t n,
                         std::mt19937_64& rng) {
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::vector<int32_t> ids;
  ids.reserve(n);
  for (int64_t i = 0; i < n; ++i) ids.push_back(pool[pick(rng)]);
  std::string text = tok.decode(ids);
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::vector<int32_t> got = tok.encode(text);
    if (static_cast<int64_t>(got.size()) == n) return text;
    if (static_cast<int64_t>(got.size()) > n) {
      got.resize(n);
    } else {
      while (static_cast<int64_t>(got.size()) < n) got.push_back(pool[pick(rng)]);
    }
    text = tok.decode(got);
  }
  return text;  // close enough after 16 rounds; the server's usage gives the true count
}

}  // namespace

Result<std::vector<BenchRequest>> tokenizer_prompts(const std::string& model_dir,
                                                    const std::vector<LengthPair>& lengths,
                                                    uint64_t seed) {
  auto tok = Tokenizer::load(model_dir);
  if (!tok.ok()) return make_error("--tokenizer {}: {}", model_dir, tok.error().message);
  // Ids whose bytes are printable-ish and not special, so decoded prompts are plain text.
  std::vector<int32_t> pool;
  for (int32_t id = 0; id < tok->vocab_size(); ++id) {
    if (tok->is_special(id)) continue;
    std::string bytes = tok->token_bytes(id);
    if (bytes.empty()) continue;
    bool ok = std::all_of(bytes.begin(), bytes.end(), [](char c) {
      auto u = static_cast<unsigned char>(c);
      return u >= 0x20 && u < 0x7f;
    });
    if (ok) pool.push_back(id);
  }
  if (pool.empty()) return make_error("--tokenizer {}: no printable tokens in the vocabulary", model_dir);
  std::mt19937_64 rng(seed ^ 0x5bd1e995ull);
  std::vector<BenchRequest> out;
  out.reserve(lengths.size());
  for (const LengthPair& l : lengths) {
    BenchRequest r;
    r.prompt = exact_prompt(*tok, pool, l.input, rng);
    r.input_tokens = static_cast<int64_t>(tok->encode(r.prompt).size());
    r.output_tokens = l.output;
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<int64_t>> count_tokens(const std::string& model_dir,
                                          const std::vector<std::string>& texts) {
  auto tok = Tokenizer::load(model_dir);
  if (!tok.ok()) return make_error("--tokenizer {}: {}", model_dir, tok.error().message);
  std::vector<int64_t> counts;
  counts.reserve(texts.size());
  for (const auto& t : texts) counts.push_back(static_cast<int64_t>(tok->encode(t).size()));
  return counts;
}

#else

Result<std::vector<BenchRequest>> tokenizer_prompts(const std::string& model_dir,
                                                    const std::vector<LengthPair>&, uint64_t) {
  return make_error("--tokenizer {}: this build has no tokenizer module", model_dir);
}

Result<std::vector<int64_t>> count_tokens(const std::string& model_dir,
                                          const std::vector<std::string>&) {
  return make_error("--tokenizer {}: this build has no tokenizer module", model_dir);
}

#endif

}  // namespace moat::bench
