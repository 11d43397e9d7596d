// Fuzz target: the server's request side (src/server/protocol.h) on what a client can send. The
// first byte picks the endpoint (/v1/completions, /v1/chat/completions, /tokenize, /detokenize),
// the rest is the body: parse_request, then prepare against models/k3-nano (its tokenizer and chat
// template, a 256-token context), as `moat serve` runs them before a request reaches the engine.
// Refusals are fine; crashes, hangs, sanitizer reports and a prepared request the engine could not
// run (a token id outside the vocabulary, a prompt + max_tokens past the context) are not.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <variant>

#include "server/protocol.h"

namespace {

struct Nano {
  moat::Tokenizer tokenizer;
  std::optional<moat::ChatTemplate> chat_template;
  moat::server::ModelInfo info;
};

const moat::server::ModelInfo& nano() {
  static Nano* n = [] {
    auto* x = new Nano;
    auto t = moat::Tokenizer::load(MOAT_SOURCE_DIR "/models/k3-nano");
    if (!t.ok()) __builtin_trap();
    x->tokenizer = std::move(t).value();
    auto p = moat::ChatTemplate::parse(x->tokenizer.chat_template());
    if (!p.ok()) __builtin_trap();
    x->chat_template = std::move(p).value();
    x->info.tokenizer = &x->tokenizer;
    x->info.chat_template = &*x->chat_template;
    x->info.eos_token_ids = {*x->tokenizer.eos_id()};
    x->info.max_model_len = 256;
    x->info.vocab_size = x->tokenizer.vocab_size();
    return x;
  }();
  return n->info;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moat::server;
  if (size == 0) return 0;
  const ModelInfo& model = nano();
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
    case 1: {
      auto parsed = parse_request(body, data[0] % 4 == 0 ? Api::completions : Api::chat);
      const auto* request = std::get_if<OpenAIRequest>(&parsed);
      if (request == nullptr) return 0;
      auto prepared = prepare(*request, model);
      const auto* ok = std::get_if<PreparedRequest>(&prepared);
      if (ok == nullptr) return 0;
      for (const moat::GenerateRequest& r : ok->requests) {
        if (r.prompt.empty()) __builtin_trap();
        for (int32_t id : r.prompt)
          if (id < 0 || id >= model.vocab_size) __builtin_trap();
        if (r.stop.max_tokens < 0 ||
            static_cast<int64_t>(r.prompt.size()) + r.stop.max_tokens > model.max_model_len)
          __builtin_trap();
      }
      return 0;
    }
    case 2:
      (void)tokenize(body, model);
      return 0;
    default:
      (void)detokenize(body, model);
      return 0;
  }
}
