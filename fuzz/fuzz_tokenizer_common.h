// What the tokenizer fuzz targets do with a tokenizer that loaded: encode and decode fixed texts
// (ASCII, CJK, emoji, invalid UTF-8, special-token lookalikes) and stream the ids back through
// the incremental detokenizer. Any id encode returns must be inside the vocabulary.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace moat_fuzz {

inline void exercise(const moat::Tokenizer& tok) {
  static const std::string kTexts[] = {
      "Hello, world! It's 2024; numbers 12345 and   spaces\n\n\ttabs.",
      "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x98\x80 caf\xc3\xa9",
      std::string("bad \xff\xfe utf8 \xc3 end\0nul", sizeof("bad \xff\xfe utf8 \xc3 end\0nul") - 1),
      "<|im_start|>user<|im_end|><s></s><\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
  };
  const int32_t vocab = tok.vocab_size();
  for (const std::string& text : kTexts) {
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= vocab) __builtin_trap();
    (void)tok.decode(ids);
    moat::IncrementalDetokenizer detok(tok);
    for (int32_t id : ids) (void)detok.push(id);
    (void)detok.flush();
  }
  (void)tok.token_bytes(-1);
  (void)tok.token_bytes(vocab);
  (void)tok.decode({-5, vocab, vocab + 1000});
  (void)tok.token_to_id("<s>");
  (void)tok.is_special(vocab);
  (void)tok.bos_id();
  (void)tok.eos_id();
}

}  // namespace moat_fuzz
