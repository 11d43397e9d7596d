// Fuzz target: Hugging Face tokenizer.json loading (vocab, merges, added tokens, normalizer,
// pre-tokenizer regexes, decoder), then encode/decode with what loaded. Input:
// "<tokenizer.json>[\0<tokenizer_config.json>]".
#include <cstddef>
#include <cstdint>

#include "fuzz_tokenizer_common.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moat_fuzz::write_with_config("tokenizer.json", std::string_view(reinterpret_cast<const char*>(data), size));
  auto tok = moat::Tokenizer::load(moat_fuzz::scratch_dir());
  if (tok.ok()) moat_fuzz::exercise(tok.value());
  return 0;
}
