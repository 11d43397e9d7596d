#include "server/protocol.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>

namespace moat::server {
namespace {

using json = nlohmann::ordered_json;
constexpr int32_t kMaxTopLogprobs = 20;  // SamplingParams::validate's limit (OpenAI, vLLM)

// A short rendering of a bad value for an error message; never throws on bad UTF-8, and never
// walks into a container (dump() recurses, and a hostile body can nest 100k levels deep).
std::string show(const json& v) {
  if (v.is_array()) return fmt::format("a list of {} elements", v.size());
  if (v.is_object()) return fmt::format("an object of {} fields", v.size());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Nesting depth of a JSON text (brackets outside strings). Checked before parsing: nlohmann's
// parser copes with any depth, but dump(), the destructor's callers and the chat template recurse.
int json_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// The body as a JSON object, or the 400 that says why not.
std::variant<json, ApiError> parse_body(std::string_view body) {
  constexpr int kMaxDepth = 64;
  if (int d = json_depth(body); d > kMaxDepth)
    return invalid_param("", fmt::format("the JSON body is nested {} levels deep; at most {} are accepted", d, kMaxDepth));
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e400
    std::string what = e.what();
    if (size_t p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    return invalid_param("", "malformed JSON body: " + what);
  }
  if (!j.is_object()) return invalid_param("", fmt::format("the body must be a JSON object, got {}", show(j)));
  return j;
}

bool to_int64(const json& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return true;
  }
  // 5.0 is an integer to pydantic's lax mode (vLLM), so it is here too.
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) >= 9.2e18) return false;
    out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

// Reads typed fields of one JSON object; the first error wins and later reads are no-ops.
class Fields {
 public:
  explicit Fields(const json& obj) : obj_(obj) {}
  std::optional<ApiError>& error() { return error_; }
  bool failed() const { return error_.has_value(); }
  bool fail(std::string param, std::string message) {
    if (!error_) error_ = invalid_param(std::move(param), std::move(message));
    return false;
  }
  // The value, or nullptr when absent or null.
  const json* get(const char* name) const {
    auto it = obj_.find(name);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }

  bool integer(const char* name, int64_t lo, int64_t hi, int64_t& out) {
    const json* v = get(name);
    if (!v || failed()) return false;
    int64_t x = 0;
    if (!to_int64(*v, x) || v->is_boolean()) return fail(name, fmt::format("{} must be an integer, got {}", name, show(*v)));
    if (x < lo || x > hi) {
      const std::string range = hi == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
      return fail(name, fmt::format("{} must be {}, got {}", name, range, x));
    }
    out = x;
    return true;
  }
  // lo_open: the lower bound itself is excluded.
  bool number(const char* name, double lo, double hi, float& out, bool lo_open = false) {
    const json* v = get(name);
    if (!v || failed()) return false;
    if (!v->is_number()) return fail(name, fmt::format("{} must be a number, got {}", name, show(*v)));
    const double x = v->get<double>();
    if (!std::isfinite(x) || (lo_open ? x <= lo : x < lo) || x > hi) {
      std::string range;
      if (hi == std::numeric_limits<double>::infinity()) range = fmt::format("{} {}", lo_open ? ">" : ">=", lo);
      else range = fmt::format("in {}{}, {}]", lo_open ? "(" : "[", lo, hi);
      return fail(name, fmt::format("{} must be {}, got {}", name, range, show(*v)));
    }
    out = static_cast<float>(x);
    return true;
  }
  bool boolean(const char* name, bool& out) {
    const json* v = get(name);
    if (!v || failed()) return false;
    if (!v->is_boolean()) return fail(name, fmt::format("{} must be true or false, got {}", name, show(*v)));
    out = v->get<bool>();
    return true;
  }
  bool string(const char* name, std::string& out) {
    const json* v = get(name);
    if (!v || failed()) return false;
    if (!v->is_string()) return fail(name, fmt::format("{} must be a string, got {}", name, show(*v)));
    out = v->get<std::string>();
    return true;
  }

 private:
  const json& obj_;
  std::optional<ApiError> error_;
};

bool token_ids(Fields& f, const std::string& param, const json& arr, std::vector<int32_t>& out) {
  out.clear();
  out.reserve(arr.size());
  for (const json& v : arr) {
    int64_t x = 0;
    if (v.is_boolean() || !to_int64(v, x))
      return f.fail(param, fmt::format("{} must be a list of token ids (integers), got an element {}", param, show(v)));
    if (x < 0 || x > std::numeric_limits<int32_t>::max())
      return f.fail(param, fmt::format("{}: token id {} is out of range", param, x));
    out.push_back(static_cast<int32_t>(x));
  }
  return true;
}

void parse_prompts(Fields& f, OpenAIRequest& r, const ParseLimits& limits) {
  const json* p = f.get("prompt");
  if (!p) {
    f.fail("prompt", "prompt is required");
    return;
  }
  auto one = [&](const json& v) -> bool {
    PromptInput in;
    if (v.is_string()) {
      in.text = v.get<std::string>();
    } else if (v.is_array()) {
      in.is_ids = true;
      if (!token_ids(f, "prompt", v, in.ids)) return false;
      if (in.ids.empty()) return f.fail("prompt", "prompt must not be an empty list of token ids");
    } else {
      return f.fail("prompt", fmt::format("prompt must be a string, a list of token ids, or a list of those; got {}", show(v)));
    }
    r.prompts.push_back(std::move(in));
    return true;
  };
  if (p->is_string()) {
    one(*p);
    return;
  }
  if (!p->is_array()) {
    one(*p);
    return;
  }
  if (p->empty()) {
    f.fail("prompt", "prompt must not be an empty list");
    return;
  }
  // [1, 2, 3] is one prompt of ids; ["a", "b"] and [[1], [2]] are several prompts.
  if (!(*p)[0].is_string() && !(*p)[0].is_array()) {
    one(*p);
    return;
  }
  if (p->size() > limits.max_prompts) {
    f.fail("prompt", fmt::format("prompt: at most {} prompts per request, got {}", limits.max_prompts, p->size()));
    return;
  }
  for (const json& v : *p) {
    if (!v.is_string() && !v.is_array()) {
      f.fail("prompt", fmt::format("prompt: a list of prompts must hold strings or lists of token ids, got {}", show(v)));
      return;
    }
    if (!one(v)) return;
  }
}

// Text parts of a content list are joined with newlines, as vLLM does.
bool message_content(Fields& f, const json& content, size_t index, json& out) {
  if (content.is_null() || content.is_string()) {
    out = content;
    return true;
  }
  const std::string param = fmt::format("messages[{}].content", index);
  if (!content.is_array())
    return f.fail(param, fmt::format("{} must be a string, a list of content parts or null, got {}", param, show(content)));
  std::string text;
  bool first = true;
  for (const json& part : content) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return f.fail(param, fmt::format("{}: each content part must be an object with a \"type\", got {}", param, show(part)));
    const std::string type = part["type"].get<std::string>();
    if (type != "text")
      return f.fail(param, fmt::format("{}: content parts of type \"{}\" are not supported (text only)", param, type));
    if (!part.contains("text") || !part["text"].is_string())
      return f.fail(param, fmt::format("{}: a text part needs a string \"text\"", param));
    if (!first) text += "\n";
    text += part["text"].get<std::string>();
    first = false;
  }
  out = text;
  return true;
}

void parse_messages(Fields& f, OpenAIRequest& r) {
  const json* m = f.get("messages");
  if (!m) {
    f.fail("messages", "messages is required");
    return;
  }
  if (!m->is_array()) {
    f.fail("messages", fmt::format("messages must be a list of messages, got {}", show(*m)));
    return;
  }
  if (m->empty()) {
    f.fail("messages", "messages must hold at least one message");
    return;
  }
  r.messages = json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    if (!msg.is_object()) {
      f.fail(fmt::format("messages[{}]", i), fmt::format("messages[{}] must be an object, got {}", i, show(msg)));
      return;
    }
    if (!msg.contains("role") || !msg["role"].is_string() || msg["role"].get<std::string>().empty()) {
      f.fail(fmt::format("messages[{}].role", i), fmt::format("messages[{}].role must be a non-empty string", i));
      return;
    }
    json out = json::object();
    out["role"] = msg["role"];
    json content;
    if (!message_content(f, msg.contains("content") ? msg["content"] : json(), i, content)) return;
    out["content"] = content;
    // name, tool_calls, tool_call_id, reasoning_content...: the template decides what they mean.
    for (auto it = msg.begin(); it != msg.end(); ++it)
      if (it.key() != "role" && it.key() != "content") out[it.key()] = it.value();
    r.messages.push_back(std::move(out));
  }
}

void parse_stop(Fields& f, OpenAIRequest& r, const ParseLimits& limits) {
  if (const json* s = f.get("stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > limits.max_stop) {
        f.fail("stop", fmt::format("stop: at most {} stop strings, got {}", limits.max_stop, s->size()));
        return;
      }
      for (const json& v : *s) {
        if (!v.is_string()) {
          f.fail("stop", fmt::format("stop must be a string or a list of strings, got an element {}", show(v)));
          return;
        }
        r.stop.push_back(v.get<std::string>());
      }
    } else {
      f.fail("stop", fmt::format("stop must be a string or a list of strings, got {}", show(*s)));
      return;
    }
    for (const std::string& str : r.stop) {
      if (str.empty()) {
        f.fail("stop", "stop: empty stop strings are not allowed");
        return;
      }
      if (str.size() > limits.max_stop_bytes) {
        f.fail("stop", fmt::format("stop: each stop string must be at most {} bytes, got one of {}", limits.max_stop_bytes,
                                   str.size()));
        return;
      }
    }
  }
  if (const json* ids = f.get("stop_token_ids")) {
    if (!ids->is_array()) {
      f.fail("stop_token_ids", fmt::format("stop_token_ids must be a list of token ids, got {}", show(*ids)));
      return;
    }
    if (ids->size() > limits.max_stop_token_ids) {
      f.fail("stop_token_ids", fmt::format("stop_token_ids: at most {} ids, got {}", limits.max_stop_token_ids, ids->size()));
      return;
    }
    token_ids(f, "stop_token_ids", *ids, r.stop_token_ids);
  }
}

void parse_logit_bias(Fields& f, OpenAIRequest& r) {
  const json* b = f.get("logit_bias");
  if (!b) return;
  if (!b->is_object()) {
    f.fail("logit_bias", fmt::format("logit_bias must be an object of token id -> bias, got {}", show(*b)));
    return;
  }
  for (auto it = b->begin(); it != b->end(); ++it) {
    const std::string& key = it.key();
    int64_t id = 0;
    size_t used = 0;
    bool ok = !key.empty() && key.size() <= 10 && std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (ok) {
      try {
        id = std::stoll(key, &used);
      } catch (...) {
        ok = false;
      }
    }
    if (!ok || id > std::numeric_limits<int32_t>::max()) {
      f.fail("logit_bias",
             fmt::format("logit_bias: keys must be token ids (non-negative integers as strings), got {}", show(json(key))));
      return;
    }
    if (!it.value().is_number() || !std::isfinite(it.value().get<double>())) {
      f.fail("logit_bias", fmt::format("logit_bias: the bias of token id {} must be a number, got {}", id, show(it.value())));
      return;
    }
    const double bias = it.value().get<double>();
    if (bias < -100.0 || bias > 100.0) {
      f.fail("logit_bias", fmt::format("logit_bias: the bias of token id {} must be in [-100, 100], got {}", id, bias));
      return;
    }
    r.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
}

// Parameters moat does not implement are refused by name rather than silently ignored, when
// ignoring them would change the output the client asked for.
void refuse_unsupported(Fields& f, Api api, int n) {
  if (const json* v = f.get("best_of")) {
    int64_t b = 0;
    if (!to_int64(*v, b) || v->is_boolean() || b < 1)
      f.fail("best_of", fmt::format("best_of must be a positive integer, got {}", show(*v)));
    else if (b != 1 && b != n)
      f.fail("best_of", "best_of other than n is not supported");
  }
  if (const json* v = f.get("suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
    f.fail("suffix", "suffix is not supported");
  if (const json* v = f.get("prompt_logprobs"); v && !(v->is_number_integer() && v->get<int64_t>() == 0))
    f.fail("prompt_logprobs", "prompt_logprobs is not supported");
  if (const json* v = f.get("response_format")) {
    if (!v->is_object() || !v->contains("type") || !(*v)["type"].is_string())
      f.fail("response_format", "response_format must be an object with a \"type\"");
    else if ((*v)["type"].get<std::string>() != "text")
      f.fail("response_format", fmt::format("response_format type \"{}\" is not supported (no structured output); use \"text\"",
                                            (*v)["type"].get<std::string>()));
  }
  for (const char* guided : {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"})
    if (f.get(guided)) f.fail(guided, fmt::format("{} is not supported (no structured output)", guided));
  if (api == Api::chat) {
    if (const json* v = f.get("tool_choice"); v && !(v->is_string() && v->get<std::string>() == "none"))
      f.fail("tool_choice", "tool_choice other than \"none\" is not supported: moat does not parse tool calls");
    if (const json* v = f.get("function_call"); v && !(v->is_string() && v->get<std::string>() == "none"))
      f.fail("function_call", "function_call other than \"none\" is not supported: moat does not parse tool calls");
  }
  if (const json* v = f.get("use_beam_search"); v && !(v->is_boolean() && !v->get<bool>()))
    f.fail("use_beam_search", "beam search is not supported");
  if (f.get("truncate_prompt_tokens")) f.fail("truncate_prompt_tokens", "truncate_prompt_tokens is not supported");
  if (f.get("chat_template")) f.fail("chat_template", "a per-request chat_template is not supported: the model's own is used");
}

// Every field a request may carry: OpenAI's, and vLLM's extensions that clients send. Any other
// name is refused, so a misspelt parameter ("max_token") is an error instead of being silently
// ignored; the ones moat accepts but does not act on are listed last.
bool known_field(const std::string& name, Api api) {
  static const std::set<std::string> common = {
      "model", "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
      "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logit_bias", "stop", "stop_token_ids",
      "ignore_eos", "n", "best_of", "stream", "stream_options", "logprobs", "user", "add_special_tokens",
      "include_stop_str_in_output", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
      "structured_outputs", "prompt_logprobs", "use_beam_search", "truncate_prompt_tokens",
      // accepted, no effect on the output
      "skip_special_tokens", "spaces_between_special_tokens", "length_penalty", "priority", "request_id", "store",
      "metadata", "service_tier"};
  static const std::set<std::string> completions = {"prompt", "echo", "suffix"};
  static const std::set<std::string> chat = {
      "messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "add_generation_prompt",
      "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
      // accepted, no effect on the output
      "parallel_tool_calls", "modalities", "reasoning_effort", "echo"};
  return common.count(name) || (api == Api::completions ? completions : chat).count(name);
}

}  // namespace

nlohmann::ordered_json error_json(const ApiError& e) {
  json err = {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return {{"error", err}};
}

ApiError invalid_param(std::string param, std::string message) {
  return ApiError{.status = 400, .message = std::move(message), .type = "invalid_request_error", .param = std::move(param)};
}

ApiError refusal_error(const AsyncEngine::Refusal& refusal, bool chat) {
  switch (refusal.kind) {
    case AsyncEngine::SubmitError::queue_full:
      return {.status = 429, .message = refusal.message, .type = "rate_limit_error", .code = "queue_full"};
    case AsyncEngine::SubmitError::shutting_down:
      return {.status = 503, .message = refusal.message, .type = "service_unavailable_error", .code = "shutting_down"};
    case AsyncEngine::SubmitError::invalid: break;
  }
  // The engine's messages begin with the parameter they name ("top_p must be...",
  // "logit_bias: ...", "prompt (12 tokens) + max_tokens (...) ... exceeds the context ...").
  const std::string& m = refusal.message;
  ApiError e = invalid_param("", m);
  size_t end = 0;
  while (end < m.size() && (std::islower(static_cast<unsigned char>(m[end])) || m[end] == '_')) ++end;
  const std::string word = m.substr(0, end);
  static const char* kParams[] = {"temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty", "top_logprobs", "logit_bias", "max_tokens", "min_tokens",
                                  "stop_token_ids", "stop", "prompt"};
  for (const char* p : kParams)
    if (word == p) e.param = p;
  if (e.param == "prompt" && chat) e.param = "messages";
  if (m.find("exceeds the context") != std::string::npos || m.find("KV blocks") != std::string::npos) {
    e.code = "context_length_exceeded";
    if (e.param.empty() || e.param == "prompt" || e.param == "messages") e.param = "max_tokens";
  }
  return e;
}

std::variant<OpenAIRequest, ApiError> parse_request(std::string_view body, Api api, const ParseLimits& limits) {
  auto parsed = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  const json& j = std::get<json>(parsed);

  OpenAIRequest r;
  r.api = api;
  Fields f(j);
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!known_field(it.key(), api))
      return invalid_param(it.key(), fmt::format("unknown parameter {} for {}", show(json(it.key())),
                                                 api == Api::chat ? "/v1/chat/completions" : "/v1/completions"));
  f.string("model", r.model);
  if (api == Api::completions) parse_prompts(f, r, limits);
  else parse_messages(f, r);

  int64_t x = 0;
  // max_completion_tokens is the newer name; it wins when both are given (vLLM).
  if (f.integer("max_tokens", 1, std::numeric_limits<int64_t>::max(), x)) r.max_tokens = x;
  if (f.integer("max_completion_tokens", 1, std::numeric_limits<int64_t>::max(), x)) r.max_tokens = x;
  if (f.integer("min_tokens", 0, std::numeric_limits<int64_t>::max(), x)) r.min_tokens = x;
  if (r.max_tokens && r.min_tokens > *r.max_tokens)
    f.fail("min_tokens", fmt::format("min_tokens ({}) must not exceed max_tokens ({})", r.min_tokens, *r.max_tokens));

  const double inf = std::numeric_limits<double>::infinity();
  SamplingParams& s = r.sampling;
  f.number("temperature", 0.0, inf, s.temperature);
  f.number("top_p", 0.0, 1.0, s.top_p, /*lo_open=*/true);
  if (f.integer("top_k", -1, std::numeric_limits<int32_t>::max(), x)) s.top_k = static_cast<int32_t>(x);
  f.number("min_p", 0.0, 1.0, s.min_p);
  f.number("presence_penalty", -2.0, 2.0, s.presence_penalty);
  f.number("frequency_penalty", -2.0, 2.0, s.frequency_penalty);
  f.number("repetition_penalty", 0.0, inf, s.repetition_penalty, /*lo_open=*/true);
  if (const json* seed = f.get("seed"); seed && !f.failed()) {
    if (seed->is_number_unsigned()) s.seed = seed->get<uint64_t>();
    else if (int64_t v = 0; !seed->is_boolean() && to_int64(*seed, v)) s.seed = static_cast<uint64_t>(v);
    else f.fail("seed", fmt::format("seed must be an integer, got {}", show(*seed)));
  }
  parse_logit_bias(f, r);
  parse_stop(f, r, limits);
  f.boolean("ignore_eos", r.ignore_eos);
  f.boolean("include_stop_str_in_output", r.include_stop_str_in_output);
  if (f.integer("n", 1, limits.max_n, x)) r.n = static_cast<int>(x);
  if (r.prompts.size() * static_cast<size_t>(r.n) > limits.max_choices)
    f.fail("n", fmt::format("n ({}) x prompts ({}) must be at most {}", r.n, r.prompts.size(), limits.max_choices));

  f.boolean("stream", r.stream);
  if (const json* so = f.get("stream_options"); so && !f.failed()) {
    if (!so->is_object()) f.fail("stream_options", fmt::format("stream_options must be an object, got {}", show(*so)));
    else if (!r.stream) f.fail("stream_options", "stream_options is only allowed with \"stream\": true");
    else {
      Fields sf(*so);
      sf.boolean("include_usage", r.include_usage);
      if (sf.failed()) {
        ApiError e = *sf.error();
        e.param = "stream_options." + e.param;
        f.error() = e;
      }
    }
  }

  if (api == Api::completions) {
    f.boolean("echo", r.echo);
    if (const json* lp = f.get("logprobs"); lp && !f.failed()) {
      if (f.integer("logprobs", 0, kMaxTopLogprobs, x)) {
        r.logprobs = true;
        r.top_logprobs = static_cast<int32_t>(x);
      }
    }
    if (r.echo && r.logprobs)
      f.fail("echo", "echo with logprobs is not supported: it needs the prompt's logprobs, which moat does not compute");
  } else {
    f.boolean("logprobs", r.logprobs);
    if (f.integer("top_logprobs", 0, kMaxTopLogprobs, x)) {
      r.top_logprobs = static_cast<int32_t>(x);
      if (x > 0 && !r.logprobs) f.fail("top_logprobs", "top_logprobs needs \"logprobs\": true");
    }
    f.boolean("add_generation_prompt", r.add_generation_prompt);
    f.boolean("continue_final_message", r.continue_final_message);
    if (r.add_generation_prompt && r.continue_final_message && f.get("add_generation_prompt"))
      f.fail("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true");
    if (r.continue_final_message) r.add_generation_prompt = false;
    if (const json* t = f.get("tools"); t && !f.failed()) {
      if (!t->is_array()) f.fail("tools", fmt::format("tools must be a list, got {}", show(*t)));
      else r.tools = *t;
    }
    if (const json* k = f.get("chat_template_kwargs"); k && !f.failed()) {
      if (!k->is_object()) f.fail("chat_template_kwargs", "chat_template_kwargs must be an object");
      else r.chat_template_kwargs = *k;
    }
  }
  s.logprobs = r.logprobs;
  s.top_logprobs = r.top_logprobs;
  bool special = false;
  if (f.boolean("add_special_tokens", special)) r.add_special_tokens = special;
  f.string("user", r.user);
  refuse_unsupported(f, api, r.n);
  if (f.failed()) return *f.error();
  return r;
}

std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view text, bool add_special_tokens) {
  std::vector<int32_t> ids = tokenizer.encode(text);
  if (add_special_tokens && tokenizer.bos_id() && (ids.empty() || ids[0] != *tokenizer.bos_id()))
    ids.insert(ids.begin(), *tokenizer.bos_id());
  return ids;
}

Result<std::string> render_chat(const ModelInfo& model, const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                bool continue_final_message, const nlohmann::ordered_json& tools,
                                const nlohmann::ordered_json& kwargs) {
  if (!model.chat_template) return make_error("this model has no chat template (tokenizer_config.json chat_template)");
  const Tokenizer& tok = *model.tokenizer;
  json context = json::object();
  // Extra variables first, so that the ones the server sets win (transformers does the same).
  for (auto it = kwargs.begin(); it != kwargs.end(); ++it) context[it.key()] = it.value();
  context["messages"] = messages;
  if (!tools.is_null()) context["tools"] = tools;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = tok.bos_id() ? tok.token_bytes(*tok.bos_id()) : "";
  context["eos_token"] = tok.eos_id() ? tok.token_bytes(*tok.eos_id()) : "";
  MOAT_ASSIGN_OR_RETURN(std::string text, model.chat_template->render(context));
  if (continue_final_message && !messages.empty()) {
    // The prompt ends inside the last message: cut what the template wrote after its content
    // (vLLM's continue_final_message).
    const json& last = messages.back();
    if (last.contains("content") && last["content"].is_string()) {
      const std::string content = last["content"].get<std::string>();
      if (size_t p = text.rfind(content); p != std::string::npos && !content.empty()) text.resize(p + content.size());
    }
  }
  return text;
}

std::variant<PreparedRequest, ApiError> prepare(const OpenAIRequest& request, const ModelInfo& model) {
  const Tokenizer& tok = *model.tokenizer;
  const bool chat = request.api == Api::chat;
  const char* prompt_param = chat ? "messages" : "prompt";
  std::vector<std::vector<int32_t>> prompts;
  PreparedRequest out;
  if (chat) {
    if (!model.chat_template)
      return ApiError{.status = 400, .message = "this model has no chat template: use /v1/completions", .param = "messages"};
    auto text = render_chat(model, request.messages, request.add_generation_prompt, request.continue_final_message,
                            request.tools, request.chat_template_kwargs);
    if (!text) return invalid_param("messages", "the chat template failed on these messages: " + text.error().message);
    // The template writes BOS itself; special tokens in the rendered text are matched by encode().
    prompts.push_back(encode_prompt(tok, *text, request.add_special_tokens.value_or(false)));
    out.echo.emplace_back();
  } else {
    for (const PromptInput& p : request.prompts) {
      if (p.is_ids) {
        prompts.push_back(p.ids);
        out.echo.push_back(request.echo ? tok.decode(p.ids) : std::string());
      } else {
        prompts.push_back(encode_prompt(tok, p.text, request.add_special_tokens.value_or(true)));
        out.echo.push_back(request.echo ? p.text : std::string());
      }
    }
  }
  for (const auto& ids : prompts) {
    const int64_t len = static_cast<int64_t>(ids.size());
    if (ids.empty()) return invalid_param(prompt_param, fmt::format("the {} is empty: at least one token is needed", prompt_param));
    for (int32_t id : ids)
      if (id < 0 || id >= model.vocab_size)
        return invalid_param(prompt_param, fmt::format("prompt token id {} outside the vocabulary of {}", id, model.vocab_size));
    int64_t max_tokens = request.max_tokens.value_or(model.max_model_len - len);
    if (!request.max_tokens && max_tokens < 1) {
      ApiError e = invalid_param(prompt_param, fmt::format("the prompt has {} tokens; the context holds {}, so no token "
                                                           "can be generated", len, model.max_model_len));
      e.code = "context_length_exceeded";
      return e;
    }
    if (max_tokens > model.max_model_len - len) {  // not len + max_tokens: max_tokens may be near INT64_MAX
      const uint64_t total = static_cast<uint64_t>(len) + static_cast<uint64_t>(max_tokens);  // < 2^64
      ApiError e = invalid_param("max_tokens", fmt::format("prompt ({} tokens) + max_tokens ({}) = {} exceeds the context of {} tokens",
                                                           len, max_tokens, total, model.max_model_len));
      e.code = "context_length_exceeded";
      return e;
    }
    if (request.min_tokens > max_tokens)
      return invalid_param("min_tokens", fmt::format("min_tokens ({}) must not exceed max_tokens ({})", request.min_tokens, max_tokens));
    out.prompt_tokens.push_back(len);
    for (int j = 0; j < request.n; ++j) {
      GenerateRequest g;
      g.prompt = ids;
      g.sampling = request.sampling;
      if (g.sampling.seed && j > 0) *g.sampling.seed += static_cast<uint64_t>(j);
      g.stop.max_tokens = max_tokens;
      g.stop.min_tokens = request.min_tokens;
      g.stop.eos_token_ids = model.eos_token_ids;
      g.stop.ignore_eos = request.ignore_eos;
      g.stop.stop_token_ids = request.stop_token_ids;
      g.stop.stop_strings = request.stop;
      out.requests.push_back(std::move(g));
    }
  }
  return out;
}

std::variant<nlohmann::ordered_json, ApiError> tokenize(std::string_view body, const ModelInfo& model) {
  auto parsed = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  const json& j = std::get<json>(parsed);
  Fields f(j);
  std::vector<int32_t> ids;
  bool return_strs = false;
  f.boolean("return_token_strs", return_strs);
  if (f.get("messages")) {
    OpenAIRequest r;
    parse_messages(f, r);
    bool add_gen = true, special = false;
    f.boolean("add_generation_prompt", add_gen);
    f.boolean("add_special_tokens", special);
    json kwargs = json::object();
    if (const json* k = f.get("chat_template_kwargs"); k && k->is_object()) kwargs = *k;
    if (f.failed()) return *f.error();
    auto text = render_chat(model, r.messages, add_gen, false, nullptr, kwargs);
    if (!text) return invalid_param("messages", "the chat template failed on these messages: " + text.error().message);
    ids = encode_prompt(*model.tokenizer, *text, special);
  } else {
    std::string prompt;
    if (!f.get("prompt")) return invalid_param("prompt", "prompt (a string) or messages is required");
    f.string("prompt", prompt);
    bool special = true;
    f.boolean("add_special_tokens", special);
    if (f.failed()) return *f.error();
    ids = encode_prompt(*model.tokenizer, prompt, special);
  }
  json out = json::object();
  out["count"] = ids.size();
  out["max_model_len"] = model.max_model_len;
  out["tokens"] = ids;
  if (return_strs) {
    json strs = json::array();
    for (int32_t id : ids) strs.push_back(token_text(*model.tokenizer, id));
    out["token_strs"] = strs;
  } else {
    out["token_strs"] = nullptr;
  }
  return out;
}

std::variant<nlohmann::ordered_json, ApiError> detokenize(std::string_view body, const ModelInfo& model) {
  auto parsed = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return *e;
  const json& j = std::get<json>(parsed);
  Fields f(j);
  const json* t = f.get("tokens");
  if (!t) return invalid_param("tokens", "tokens (a list of token ids) is required");
  if (!t->is_array()) return invalid_param("tokens", fmt::format("tokens must be a list of token ids, got {}", show(*t)));
  std::vector<int32_t> ids;
  if (!token_ids(f, "tokens", *t, ids)) return *f.error();
  for (int32_t id : ids)
    if (id >= model.vocab_size)
      return invalid_param("tokens", fmt::format("token id {} outside the vocabulary of {}", id, model.vocab_size));
  // Byte-level pieces need not be valid UTF-8 on their own; the JSON carries U+FFFD for them.
  json out = json::object();
  out["prompt"] = model.tokenizer->decode(ids);
  return out;
}

nlohmann::ordered_json finish_reason_json(FinishReason reason) {
  if (reason == FinishReason::none) return nullptr;
  return std::string(finish_reason_name(reason));
}

namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 if it is not one.
size_t utf8_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((b(i + k) & 0xC0) != 0x80) return 0;
  if (n == 2 && c < 0xC2) return 0;
  if (n == 3 && c == 0xE0 && b(i + 1) < 0xA0) return 0;
  if (n == 3 && c == 0xED && b(i + 1) >= 0xA0) return 0;
  if (n == 4 && (c > 0xF4 || (c == 0xF0 && b(i + 1) < 0x90) || (c == 0xF4 && b(i + 1) >= 0x90))) return 0;
  return n;
}

}  // namespace

std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  const std::string bytes = tokenizer.token_bytes(id);
  bool valid = true;
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_len(bytes, i);
    if (!n) {
      valid = false;
      break;
    }
    i += n;
  }
  if (valid) return bytes;
  std::string out = "bytes:";
  for (unsigned char c : bytes) out += fmt::format("\\x{:02x}", c);
  return out;
}

}  // namespace moat::server
