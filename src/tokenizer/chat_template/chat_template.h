// Renders Hugging Face chat templates (Jinja2) the way transformers does, byte for byte.
//
// The environment is transformers' ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) with loopcontrols ({% break %}, {% continue %}), a pass-through
// {% generation %} tag, default (non-strict) Undefined, tojson = json.dumps(ensure_ascii=False)
// and the globals raise_exception and strftime_now. Lists and dicts are immutable, as in the
// sandbox: calling list.append and friends is an error, exactly where transformers fails.
//
// Who calls it: the engine, once per request, with the model's tokenizer_config chat_template.
// Pipeline: lexer (whitespace control) -> parser (AST) -> tree-walking evaluator; see
// template_parser.cpp and template_render.cpp.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace moat {

namespace chat_template_detail {
struct Template;
}

class ChatTemplate {
 public:
  // Syntax errors (and unknown filters/tests outside `if` blocks, as jinja2 reports them at
  // compile time) name the line and what was expected.
  static Result<ChatTemplate> parse(std::string_view source);

  // context: an object of template variables (messages, tools, add_generation_prompt,
  // bos_token, eos_token, extra keys...). Runtime errors (raise_exception, type errors,
  // sandbox violations) come back as an Error naming the template line.
  Result<std::string> render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const chat_template_detail::Template> template_;
};

}  // namespace moat
