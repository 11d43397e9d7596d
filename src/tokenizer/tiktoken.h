// tiktoken rank files (Kimi K2's tiktoken.model): one "<base64 token bytes> <rank>" per line; the
// rank is the token id and orders the byte-pair merges. The file carries no pre-tokenizer
// pattern, so Kimi's (tokenization_kimi.py pat_str) is the default.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace moat::tiktoken {

// Kimi K2's split pattern: Han runs, letter runs with optional English contractions (Han taken
// out of the letter classes by && intersection), up to 3 digits, punctuation runs, whitespace.
inline constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Kimi reserves this many ids after the ranked tokens for special tokens; the ids that
// tokenizer_config.json does not name become "<|reserved_token_{id}|>".
inline constexpr int kNumReservedSpecialTokens = 256;

// Standard base64 (with or without '=' padding); nullopt when malformed.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace moat::tiktoken
