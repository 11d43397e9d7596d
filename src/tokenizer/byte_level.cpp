#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/unicode.h"

namespace moat::byte_level {
namespace {

struct Tables {
  std::array<std::string, 256> char_of_byte;
  std::array<int16_t, 512> byte_of_char;  // code points < 0x200 cover the whole alphabet

  Tables() {
    byte_of_char.fill(-1);
    const auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const char32_t cp = printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      unicode::append_utf8(char_of_byte[b], cp);
      byte_of_char[cp] = static_cast<int16_t>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

const std::string& char_for_byte(uint8_t byte) { return tables().char_of_byte[byte]; }

void encode_append(std::string& out, std::string_view bytes) {
  const Tables& t = tables();
  for (char c : bytes) out += t.char_of_byte[static_cast<uint8_t>(c)];
}

std::string encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  encode_append(out, bytes);
  return out;
}

std::optional<uint8_t> byte_for_char(char32_t cp) {
  if (cp >= 512) return std::nullopt;
  const int16_t b = tables().byte_of_char[cp];
  if (b < 0) return std::nullopt;
  return static_cast<uint8_t>(b);
}

std::string decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t length = unicode::valid_sequence_length(text, pos);
    if (length == 0) {  // not UTF-8 at all: pass the byte through
      out += text[pos++];
      continue;
    }
    const auto byte = byte_for_char(unicode::decode_at(text, pos, length));
    if (byte) {
      out += static_cast<char>(*byte);
    } else {
      out.append(text.substr(pos, length));
    }
    pos += length;
  }
  return out;
}

}  // namespace moat::byte_level
