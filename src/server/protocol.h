// The OpenAI request side of the server, as pure functions (no socket, no engine thread), so that
// every parameter and every refusal is unit-testable:
//
//   body --parse_request--> OpenAIRequest --prepare--> PreparedRequest (one GenerateRequest per
//   choice) --AsyncEngine::submit--> streams
//
// parse_request checks JSON types and ranges that need no model; prepare needs the model's
// tokenizer, chat template and context (ModelInfo) to tokenize, render messages and size
// max_tokens. Both return an ApiError (HTTP status + OpenAI error fields) instead of throwing.
// Unknown fields are refused by name (OpenAI does; vLLM ignores them, which hides misspelt
// parameters); JSON null means "absent" (clients send it).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/async_engine.h"
#include "engine/engine.h"
#include "tokenizer/chat_template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moat::server {

// {"error": {"message", "type", "param", "code"}} with the HTTP status it goes out with.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // "" -> null
  std::string code;   // "" -> null
};
nlohmann::ordered_json error_json(const ApiError& e);
ApiError invalid_param(std::string param, std::string message);
// An AsyncEngine refusal as the client sees it: invalid -> 400 naming the parameter (429 never
// comes from `invalid`), queue_full -> 429, shutting_down -> 503.
ApiError refusal_error(const AsyncEngine::Refusal& refusal, bool chat);

enum class Api { completions, chat };

// One prompt of a completions request: text to tokenize, or token ids as given.
struct PromptInput {
  bool is_ids = false;
  std::string text;
  std::vector<int32_t> ids;
};

struct OpenAIRequest {
  Api api = Api::completions;
  std::string model;  // "" when absent
  std::vector<PromptInput> prompts;          // completions: one or more prompts
  nlohmann::ordered_json messages;           // chat: the messages as the template sees them
  nlohmann::ordered_json tools;              // chat: passed to the template; null when absent
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  std::optional<bool> add_special_tokens;    // absent: BOS for completions, none for chat (vLLM)

  SamplingParams sampling;                   // OpenAI's defaults: temperature 1, no truncation
  std::optional<int64_t> max_tokens;         // absent: the rest of the context (vLLM)
  int64_t min_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;   // vLLM: the matched stop string ends the text
  int n = 1;
  bool stream = false;
  bool include_usage = false;                // stream_options.include_usage
  bool echo = false;                         // completions
  bool logprobs = false;                     // completions: logprobs != null; chat: logprobs
  int32_t top_logprobs = 0;                  // completions: the logprobs int; chat: top_logprobs
  std::string user;
};

// Bounds on what one request may ask for; beyond them a request is refused with a 400 rather
// than slowing every other request's steps (stop strings are matched every token).
struct ParseLimits {
  int max_n = 16;                  // choices per prompt (n); each runs as its own engine request
  size_t max_prompts = 64;         // prompts in one completions request
  size_t max_choices = 64;         // prompts x n
  size_t max_stop = 64;            // stop strings (OpenAI allows 4, vLLM any number)
  size_t max_stop_bytes = 1024;    // per stop string
  size_t max_stop_token_ids = 1024;
};

std::variant<OpenAIRequest, ApiError> parse_request(std::string_view body, Api api, const ParseLimits& limits = {});

// What prepare needs of the loaded model. Pointers are borrowed and must outlive the calls.
struct ModelInfo {
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;  // null: the model has none, chat is refused
  std::vector<int32_t> eos_token_ids;
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
};

struct PreparedRequest {
  // choice-major within prompt: choice index i = prompt * n + j runs requests[i]
  std::vector<GenerateRequest> requests;
  std::vector<int64_t> prompt_tokens;  // per prompt
  std::vector<std::string> echo;       // per prompt: the prompt text when echo, else ""
};

// Tokenizes (or renders and tokenizes) the prompts and builds one engine request per choice:
// max_tokens defaults to the rest of the context, the model's EOS ids are added, a seeded n > 1
// request gives choice j the seed + j (distinct but reproducible, as vLLM). Errors: 400 for a
// prompt that is empty, outside the vocabulary or too long for the context (both numbers named),
// a template that fails, or a chat request to a model without a chat template.
std::variant<PreparedRequest, ApiError> prepare(const OpenAIRequest& request, const ModelInfo& model);

// The chat template applied to `messages` (transformers' apply_chat_template semantics).
Result<std::string> render_chat(const ModelInfo& model, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, bool continue_final_message = false,
                                const nlohmann::ordered_json& tools = nullptr,
                                const nlohmann::ordered_json& kwargs = nlohmann::ordered_json::object());

// Token ids for a prompt text: BOS first when add_special_tokens and the tokenizer has one and
// the text does not already start with it.
std::vector<int32_t> encode_prompt(const Tokenizer& tokenizer, std::string_view text, bool add_special_tokens);

// vLLM's /tokenize and /detokenize bodies -> response JSON, or an error.
std::variant<nlohmann::ordered_json, ApiError> tokenize(std::string_view body, const ModelInfo& model);
std::variant<nlohmann::ordered_json, ApiError> detokenize(std::string_view body, const ModelInfo& model);

// "stop" / "length" / "abort"; null while running.
nlohmann::ordered_json finish_reason_json(FinishReason reason);
// The text of one token for logprobs: its bytes as UTF-8, or "bytes:\xNN..." (vLLM's form) when
// the token is not valid UTF-8 on its own.
std::string token_text(const Tokenizer& tokenizer, int32_t id);

}  // namespace moat::server
