// The immutable state behind a Tokenizer, filled by the loaders (tokenizer.cpp for
// tokenizer.json, tiktoken.cpp for rank files) and read by encode/decode.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "tokenizer/added_vocab.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"

namespace moat {

// The largest token id a vocabulary file may use. The per-id tables are sized by the largest id,
// so one id of 2^31 in a hostile file would allocate ~100 GB; real vocabularies stay below 2^20.
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
// How many ids below the largest may name no token. The tables are sized by the largest id, not
// by the tokens a file defines, so one sparse id (a special token at 16,000,000 after a vocabulary
// of 4096) would allocate ~1 GB per load; real files leave at most a few hundred ids unused.
inline constexpr int64_t kMaxUnusedTokenIds = int64_t{1} << 16;

// Refuses a vocabulary whose ids run to max_id while at most `defined` of them name a token.
Status check_token_ids_dense(int64_t max_id, int64_t defined, std::string_view what);

struct TokenizerData {
  BpeModel model;
  PreTokenizer pre_tokenizer;
  AddedVocabulary added;
  // Invalid UTF-8 in the input (which no regex may see) still encodes: byte by byte through the
  // byte-level alphabet, or as raw bytes for tiktoken.
  enum class StrayBytes { kDrop, kByteLevel, kRaw } stray_bytes = StrayBytes::kDrop;

  // Indexed by id; all of size vocab_size().
  std::vector<std::string> bytes_of_id;  // what decode() emits
  std::vector<std::string> token_of_id;  // stored string form
  std::vector<uint8_t> special;
  StringMap<int32_t> id_of_token;        // stored string form -> id
  StringMap<int32_t> id_of_bytes;        // raw bytes -> id (first id wins)

  std::optional<int32_t> bos_id;
  std::optional<int32_t> eos_id;
  std::string chat_template;

  // Fills id_of_token / id_of_bytes / special from the per-id tables and the added tokens.
  void index();
};

// Reads and parses a JSON file; the error names the file and the parse position.
Result<nlohmann::json> read_json_file(const std::filesystem::path& path);

// What the loaders take from tokenizer_config.json (all optional).
struct TokenizerConfig {
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::string chat_template;
  std::vector<AddedToken> added_tokens_decoder;  // id order
};
// A missing file gives an empty config; a malformed one is an error naming the file and field.
Result<TokenizerConfig> read_tokenizer_config(const std::filesystem::path& dir);

// Sets bos/eos from the config, else from well-known special token names.
void resolve_bos_eos(const TokenizerConfig& config, TokenizerData& data);

// tiktoken.model loader (tiktoken.cpp).
Result<std::shared_ptr<const TokenizerData>> load_tiktoken(const std::filesystem::path& dir);

}  // namespace moat
