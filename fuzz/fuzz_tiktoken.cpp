// Fuzz target: tiktoken rank file loading (Kimi K2's tiktoken.model, specials from
// tokenizer_config.json), then encode/decode. Input: "<tiktoken.model>[\0<tokenizer_config.json>]".
#include <cstddef>
#include <cstdint>

#include "fuzz_tokenizer_common.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moat_fuzz::write_with_config("tiktoken.model", std::string_view(reinterpret_cast<const char*>(data), size));
  auto tok = moat::Tokenizer::load(moat_fuzz::scratch_dir());
  if (tok.ok()) moat_fuzz::exercise(tok.value());
  return 0;
}
