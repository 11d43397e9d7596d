// Fuzz target: arbitrary bytes through a real tokenizer (models/k3-nano, or the directory in
// MOAT_FUZZ_TOKENIZER): encode must give ids inside the vocabulary, decode must give the input
// back byte for byte (byte-level BPE loses nothing), and streaming must end with the same text
// where the input is valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace {
const moat::Tokenizer& tokenizer() {
  static const moat::Tokenizer tok = [] {
    const char* dir = std::getenv("MOAT_FUZZ_TOKENIZER");
    auto t = moat::Tokenizer::load(dir ? dir : MOAT_SOURCE_DIR "/models/k3-nano");
    if (!t.ok()) {
      fprintf(stderr, "%s\n", t.error().message.c_str());
      std::abort();
    }
    return t.value();
  }();
  return tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const moat::Tokenizer& tok = tokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
  if (tok.decode(ids) != text) __builtin_trap();
  moat::IncrementalDetokenizer detok(tok);
  std::string streamed;
  for (int32_t id : ids) streamed += detok.push(id);
  streamed += detok.flush();
  bool valid = true;
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = moat::unicode::valid_sequence_length(text, pos);
    if (n == 0) { valid = false; break; }
    pos += n;
  }
  if (valid && streamed != text) __builtin_trap();
  return 0;
}
