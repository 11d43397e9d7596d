// The BPE model: turns one pre-tokenized word into ids. Two flavours share one merge loop:
//  - Hugging Face (tokenizer.json): symbols are the word's characters, merges are an explicit
//    rank-ordered list of (left, right) token pairs;
//  - tiktoken (rank files): symbols are the word's bytes, and two adjacent parts merge when their
//    concatenation is a token; its rank (= id) orders the merges.
// Both merge the lowest-ranked adjacent pair first (leftmost on ties) until none applies.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"

namespace moat {

// Lets unordered_map<std::string, V> be searched with a string_view without a copy.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  struct MergesOptions {
    std::optional<int32_t> unk_id;  // id for characters missing from the vocab; else dropped
    bool ignore_merges = false;     // a word that is itself in the vocab becomes that one token
  };

  // `merges` are in rank order; a pair whose concatenation is not in the vocab is an error.
  static Result<BpeModel> from_merges(StringMap<int32_t> vocab,
                                      const std::vector<std::pair<std::string, std::string>>& merges,
                                      MergesOptions options, std::string_view what);
  // `ranks`: token bytes -> rank, which is also the id.
  static BpeModel from_ranks(StringMap<int32_t> ranks);

  // Symbols (characters, or bytes for tiktoken) that the vocab lacks but that have an id
  // elsewhere, e.g. DeepSeek's byte-alphabet characters that are only added tokens. Used instead
  // of dropping them so that every byte still encodes.
  void set_symbol_fallback(StringMap<int32_t> fallback) { fallback_ = std::move(fallback); }

  // Appends the ids of `word` to `out`. Thread-safe (no mutable state).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // Vocab key -> id (token string for Hugging Face, raw bytes for tiktoken).
  const StringMap<int32_t>& vocab() const { return vocab_; }
  bool by_bytes() const { return by_bytes_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::optional<int32_t> symbol_id(std::string_view symbol) const;
  std::optional<Merge> find_merge(int32_t left, int32_t right) const;

  bool by_bytes_ = false;
  StringMap<int32_t> vocab_;
  StringMap<int32_t> fallback_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  std::vector<std::string> bytes_of_id_;        // tiktoken: token bytes by id
  MergesOptions options_;
};

}  // namespace moat
