// UTF-8 helpers shared by the tokenizer: splitting text into code points, telling valid runs from
// stray bytes (so invalid input still round-trips through byte-level BPE), and the character
// classes that added-token matching needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moat::unicode {

// Length of the well-formed UTF-8 sequence at text[pos], or 0 when the bytes there are not one
// (bad lead byte, bad continuation, overlong form, surrogate, > U+10FFFF, or cut off by the end).
size_t valid_sequence_length(std::string_view text, size_t pos);

// Decodes the sequence at text[pos] of length valid_sequence_length(text, pos) > 0.
char32_t decode_at(std::string_view text, size_t pos, size_t length);

void append_utf8(std::string& out, char32_t cp);

// How many bytes at the end of `text` are the start of a sequence that more bytes could still
// complete. The streaming detokenizer holds these back.
size_t incomplete_suffix_length(std::string_view text);

// Replaces every ill-formed sequence by U+FFFD (one per maximal ill-formed subpart, as
// WHATWG/Unicode recommend), so the result is always valid UTF-8.
std::string sanitize(std::string_view text);

// Unicode White_Space and "word" (\w: letters, marks, numbers, connector punctuation), as the
// Oniguruma tables that Hugging Face's regexes use define them.
bool is_space(char32_t cp);
bool is_word(char32_t cp);

}  // namespace moat::unicode
