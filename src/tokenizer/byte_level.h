// GPT-2's byte-level alphabet: every byte maps to one printable code point, so byte-level BPE
// vocabularies are strings of those characters. Printable Latin-1 bytes map to themselves; the
// other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) map to U+0100 onward in byte order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moat::byte_level {

// UTF-8 of the character standing for `byte`.
const std::string& char_for_byte(uint8_t byte);

// Maps every byte of `bytes` to its alphabet character.
std::string encode(std::string_view bytes);
void encode_append(std::string& out, std::string_view bytes);

// Inverse of encode. Characters outside the alphabet (e.g. in added tokens such as
// "<｜begin▁of▁sentence｜>") are kept as their UTF-8, as Hugging Face's ByteLevel decoder does.
std::string decode(std::string_view text);

// The byte a code point stands for, if it is in the alphabet.
std::optional<uint8_t> byte_for_char(char32_t cp);

}  // namespace moat::byte_level
