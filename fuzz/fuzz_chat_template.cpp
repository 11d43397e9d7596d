// Fuzz target: a chat template's source through the parser, and what parses through the renderer
// with a context like the engine's (system/user/assistant/tool messages, tool calls, tools,
// add_generation_prompt, bos/eos). Errors are fine; crashes, hangs and sanitizer reports are not.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tokenizer/chat_template/chat_template.h"

namespace {
const nlohmann::ordered_json& context() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Hi <think>there</think> \u4f60\u597d"},
      {"role": "assistant", "content": "", "reasoning_content": "hmm",
       "tool_calls": [{"id": "call_0", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
      {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "{\"temp\": 21.5}"},
      {"role": "assistant", "content": [{"type": "text", "text": "It is 21.5 C."}]},
      {"role": "user", "content": "Thanks"}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}}],
    "documents": null,
    "add_generation_prompt": true,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "thinking": true
  })");
  return ctx;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tmpl = moat::ChatTemplate::parse(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!tmpl.ok()) return 0;
  (void)tmpl.value().render(context());
  return 0;
}
