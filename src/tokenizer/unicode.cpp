#include "tokenizer/unicode.h"

#include <oniguruma.h>

namespace moat::unicode {

size_t valid_sequence_length(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  const size_t left = text.size() - pos;
  const unsigned char b0 = byte(0);
  if (b0 < 0x80) return 1;
  size_t length;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;       // overlong
    if (b0 == 0xED) hi = 0x9F;       // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;       // overlong
    if (b0 == 0xF4) hi = 0x8F;       // > U+10FFFF
  } else {
    return 0;
  }
  if (left < length) return 0;
  if (byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < length; ++i) {
    if ((byte(i) & 0xC0) != 0x80) return 0;
  }
  return length;
}

char32_t decode_at(std::string_view text, size_t pos, size_t length) {
  const auto byte = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[pos + i])); };
  switch (length) {
    case 1: return byte(0);
    case 2: return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3: return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
             (byte(3) & 0x3F);
  }
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace {

// Length of the maximal prefix of a well-formed sequence at pos (1 when even the lead byte is
// bad). Equal to the sequence length only for complete sequences.
size_t maximal_subpart(std::string_view text, size_t pos) {
  const unsigned char b0 = static_cast<unsigned char>(text[pos]);
  size_t length;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 < 0x80) return 1;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 1;
  }
  size_t i = 1;
  for (; i < length && pos + i < text.size(); ++i) {
    const unsigned char b = static_cast<unsigned char>(text[pos + i]);
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
  }
  return i;
}

}  // namespace

size_t incomplete_suffix_length(std::string_view text) {
  // A sequence is at most 4 bytes, so only the last 3 bytes can start an incomplete one.
  const size_t n = text.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t pos = n - back;
    const unsigned char b = static_cast<unsigned char>(text[pos]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    if (b < 0xC2 || b > 0xF4) return 0;  // ASCII, or a byte that never starts a sequence
    return maximal_subpart(text, pos) == back && valid_sequence_length(text, pos) == 0 ? back : 0;
  }
  return 0;
}

std::string sanitize(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t length = valid_sequence_length(text, pos);
    if (length > 0) {
      out.append(text.substr(pos, length));
      pos += length;
    } else {
      out += "\xEF\xBF\xBD";
      pos += maximal_subpart(text, pos);
    }
  }
  return out;
}

bool is_space(char32_t cp) {
  return ONIGENC_IS_CODE_CTYPE(ONIG_ENCODING_UTF8, static_cast<OnigCodePoint>(cp),
                               ONIGENC_CTYPE_SPACE);
}

bool is_word(char32_t cp) {
  return ONIGENC_IS_CODE_CTYPE(ONIG_ENCODING_UTF8, static_cast<OnigCodePoint>(cp),
                               ONIGENC_CTYPE_WORD);
}

}  // namespace moat::unicode
