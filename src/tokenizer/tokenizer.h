// Text <-> token ids for DeepSeek-V3 / Kimi K2 style models.
//
// Two on-disk formats load into the same pipeline:
//  - Hugging Face tokenizer.json with a byte-level BPE model (DeepSeek, GPT-2 family);
//  - a tiktoken rank file, tiktoken.model, whose special tokens live in tokenizer_config.json
//    (Kimi K2); it splits text with Kimi's regex and merges bytes by rank.
// Encoding: added/special tokens are matched in the raw text first (leftmost-longest), the rest
// is pre-tokenized into words and each word is BPE-encoded. Nothing (no BOS/EOS) is added.
//
// A Tokenizer is an immutable shared state: copies and moves are cheap, and every const method
// may be called from many threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace moat {

struct TokenizerData;

class Tokenizer {
 public:
  // An empty tokenizer (no vocabulary); useful only as a placeholder to assign to.
  Tokenizer();

  // `dir` holds tokenizer.json (Hugging Face) or tiktoken.model (tiktoken rank file, Kimi K2
  // style), plus optional tokenizer_config.json (bos/eos, chat template, tiktoken specials).
  static Result<Tokenizer> load(const std::filesystem::path& dir);

  // No BOS/EOS added; special and added tokens that occur in the text are matched.
  std::vector<int32_t> encode(std::string_view text) const;
  // Full decode (skips nothing). For byte-level vocabularies the result is the exact bytes, which
  // need not be valid UTF-8 (use IncrementalDetokenizer for text to show).
  std::string decode(const std::vector<int32_t>& ids) const;
  // Raw bytes of one token (byte-level decoded); empty for an unknown id.
  std::string token_bytes(int32_t id) const;
  // Max id + 1 over the vocabulary and the added tokens.
  int32_t vocab_size() const;
  // From tokenizer_config.json (bos_token / eos_token, a string or {"content": ...}), else a
  // well-known special token name if one exists.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  // A vocabulary entry (in its stored string form, e.g. "Ġthe" for byte-level vocabularies) or
  // an added token; failing that, the token whose bytes are exactly `token`.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  bool is_special(int32_t id) const;
  // tokenizer_config.json "chat_template" (or chat_template.jinja next to it), or "".
  const std::string& chat_template() const;

  // Shared with the loaders (tokenizer.cpp, tiktoken.cpp).
  explicit Tokenizer(std::shared_ptr<const TokenizerData> data);

 private:
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;

  std::shared_ptr<const TokenizerData> data_;
};

// Streams text as ids arrive. Never emits a broken UTF-8 sequence: bytes of a character split
// across tokens (e.g. an emoji) are held back until the character completes; bytes that can never
// form a character are emitted as U+FFFD, and flush() turns what is left into U+FFFD.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer);
  // Newly complete text (maybe empty).
  std::string push(int32_t id);
  std::string flush();

 private:
  Tokenizer tokenizer_;  // a cheap copy, so the detokenizer cannot outlive its tables
  std::string pending_;  // bytes of an incomplete character
};

}  // namespace moat
