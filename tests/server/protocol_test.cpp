// Request parsing and validation without a socket: every parameter, every refusal with its
// status, parameter name and message; prepare() on the shipped k3-nano tokenizer and template.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "server/metrics.h"
#include "server/protocol.h"

namespace moat::server {
namespace {

using json = nlohmann::ordered_json;
const std::filesystem::path kModel = std::filesystem::path(MOAT_SOURCE_DIR) / "models/k3-nano";

OpenAIRequest parse_ok(const std::string& body, Api api = Api::completions) {
  auto r = parse_request(body, api);
  if (auto* e = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << body << " -> " << e->message;
    return {};
  }
  return std::get<OpenAIRequest>(r);
}

ApiError parse_err(const std::string& body, Api api = Api::completions) {
  auto r = parse_request(body, api);
  if (!std::holds_alternative<ApiError>(r)) {
    ADD_FAILURE() << body << " was accepted";
    return {};
  }
  return std::get<ApiError>(r);
}

TEST(Protocol, ParsesEveryCompletionsParameter) {
  OpenAIRequest r = parse_ok(R"({
    "model": "k3-nano", "prompt": "Hello", "max_tokens": 7, "min_tokens": 2, "temperature": 0.5, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
    "seed": 1234, "stop": ["\n\n", "END"], "stop_token_ids": [5, 6], "ignore_eos": true, "n": 3,
    "stream": true, "stream_options": {"include_usage": true}, "logprobs": 4, "echo": false,
    "logit_bias": {"17": -100, "42": 2.5}, "user": "u-1", "add_special_tokens": false,
    "include_stop_str_in_output": true, "store": false, "metadata": {"a": "b"}})");
  EXPECT_EQ(r.model, "k3-nano");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "Hello");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.min_tokens, 2);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.sampling.seed, 1234u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 4);
  EXPECT_TRUE(r.sampling.logprobs);
  EXPECT_EQ(r.sampling.top_logprobs, 4);
  ASSERT_EQ(r.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(r.sampling.logit_bias[0], (std::pair<int32_t, float>{17, -100.0f}));
  EXPECT_EQ(r.sampling.logit_bias[1], (std::pair<int32_t, float>{42, 2.5f}));
  EXPECT_EQ(r.user, "u-1");
  EXPECT_EQ(r.add_special_tokens, false);
  EXPECT_TRUE(r.include_stop_str_in_output);
}

TEST(Protocol, DefaultsAreOpenAIs) {
  OpenAIRequest r = parse_ok(R"({"prompt": "x"})");
  EXPECT_FALSE(r.max_tokens.has_value()) << "absent: the rest of the context, decided by prepare()";
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.logprobs);
  EXPECT_FALSE(r.sampling.seed.has_value());
  // null is "absent"
  OpenAIRequest n = parse_ok(R"({"prompt": "x", "temperature": null, "stop": null, "max_tokens": null, "seed": null})");
  EXPECT_FLOAT_EQ(n.sampling.temperature, 1.0f);
  EXPECT_FALSE(n.max_tokens.has_value());
}

TEST(Protocol, ChatParameters) {
  OpenAIRequest r = parse_ok(R"({"messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null, "name": "bot"}],
      "max_completion_tokens": 9, "max_tokens": 100, "logprobs": true, "top_logprobs": 3,
      "add_generation_prompt": false, "chat_template_kwargs": {"thinking": true}, "tool_choice": "none"})",
                             Api::chat);
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "a\nb") << "text parts joined with newlines (vLLM)";
  EXPECT_TRUE(r.messages[2]["content"].is_null());
  EXPECT_EQ(r.messages[2]["name"], "bot");
  EXPECT_EQ(r.max_tokens, 9) << "max_completion_tokens wins over max_tokens";
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_EQ(r.chat_template_kwargs["thinking"], true);
}

TEST(Protocol, PromptForms) {
  EXPECT_EQ(parse_ok(R"({"prompt": [1, 2, 3]})").prompts.size(), 1u);
  EXPECT_TRUE(parse_ok(R"({"prompt": [1, 2, 3]})").prompts[0].is_ids);
  EXPECT_EQ(parse_ok(R"({"prompt": [1, 2, 3]})").prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  auto many = parse_ok(R"({"prompt": ["a", "b"], "n": 2})");
  EXPECT_EQ(many.prompts.size(), 2u);
  auto ids = parse_ok(R"({"prompt": [[1, 2], [3]]})");
  ASSERT_EQ(ids.prompts.size(), 2u);
  EXPECT_EQ(ids.prompts[1].ids, (std::vector<int32_t>{3}));
  EXPECT_EQ(parse_ok(R"({"prompt": [5.0]})").prompts[0].ids, (std::vector<int32_t>{5})) << "integral floats are ints";
}

TEST(Protocol, NegativeAndHugeSeedsAreAccepted) {
  EXPECT_EQ(parse_ok(R"({"prompt": "x", "seed": -1})").sampling.seed, static_cast<uint64_t>(-1));
  EXPECT_EQ(parse_ok(R"({"prompt": "x", "seed": 18446744073709551615})").sampling.seed, UINT64_MAX);
}

struct BadCase {
  std::string body;
  Api api;
  int status;
  std::string param;        // "" = null
  std::string message_has;  // a substring of the message
};

TEST(Protocol, EveryRefusalNamesItsParameter) {
  const Api C = Api::completions, H = Api::chat;
  const std::vector<BadCase> cases = {
      {R"({"prompt": "x",})", C, 400, "", "malformed JSON"},
      {R"({"prompt": "x")", C, 400, "", "malformed JSON"},
      {"", C, 400, "", "malformed JSON"},
      {"\"just a string\"", C, 400, "", "JSON object"},
      {"[1, 2]", C, 400, "", "JSON object"},
      {"{\"prompt\": \"\xff\xfe\"}", C, 400, "", "malformed JSON"},  // invalid UTF-8
      {R"({"prompt": "x", "temperature": 1e400})", C, 400, "", "malformed JSON"},  // beyond double
      {R"({})", C, 400, "prompt", "prompt is required"},
      {R"({"prompt": 5})", C, 400, "prompt", "prompt must be"},
      {R"({"prompt": []})", C, 400, "prompt", "empty"},
      {R"({"prompt": [[]]})", C, 400, "prompt", "empty"},
      {R"({"prompt": [1, -2]})", C, 400, "prompt", "out of range"},
      {R"({"prompt": [1, "a"]})", C, 400, "prompt", "token ids"},
      {R"({"prompt": ["a", 1]})", C, 400, "prompt", "list of prompts"},
      {R"({"prompt": [1.5]})", C, 400, "prompt", "token ids"},
      {R"({"prompt": {"a": 1}})", C, 400, "prompt", "prompt must be"},
      {R"({"prompt": "x", "model": 3})", C, 400, "model", "model must be a string"},
      {R"({"prompt": "x", "max_tokens": 0})", C, 400, "max_tokens", "max_tokens must be >= 1, got 0"},
      {R"({"prompt": "x", "max_tokens": -5})", C, 400, "max_tokens", "max_tokens must be >= 1"},
      {R"({"prompt": "x", "max_tokens": 5.5})", C, 400, "max_tokens", "must be an integer"},
      {R"({"prompt": "x", "max_tokens": "5"})", C, 400, "max_tokens", "must be an integer"},
      {R"({"prompt": "x", "max_tokens": true})", C, 400, "max_tokens", "must be an integer"},
      {R"({"prompt": "x", "max_tokens": 1e300})", C, 400, "max_tokens", "must be an integer"},
      {R"({"prompt": "x", "max_tokens": 99999999999999999999999})", C, 400, "max_tokens", "must be an integer"},
      {R"({"prompt": "x", "min_tokens": -1})", C, 400, "min_tokens", "min_tokens must be >= 0"},
      {R"({"prompt": "x", "min_tokens": 5, "max_tokens": 2})", C, 400, "min_tokens", "must not exceed max_tokens"},
      {R"({"prompt": "x", "temperature": -0.1})", C, 400, "temperature", "temperature must be >= 0"},
      {R"({"prompt": "x", "temperature": "hot"})", C, 400, "temperature", "must be a number"},
      {R"({"prompt": "x", "top_p": 0})", C, 400, "top_p", "top_p must be in (0, 1]"},
      {R"({"prompt": "x", "top_p": 1.5})", C, 400, "top_p", "top_p must be in (0, 1]"},
      {R"({"prompt": "x", "top_k": -2})", C, 400, "top_k", "top_k must be in [-1"},
      {R"({"prompt": "x", "top_k": 0.5})", C, 400, "top_k", "must be an integer"},
      {R"({"prompt": "x", "min_p": 2})", C, 400, "min_p", "min_p must be in [0, 1]"},
      {R"({"prompt": "x", "presence_penalty": 3})", C, 400, "presence_penalty", "[-2, 2]"},
      {R"({"prompt": "x", "frequency_penalty": -2.5})", C, 400, "frequency_penalty", "[-2, 2]"},
      {R"({"prompt": "x", "repetition_penalty": 0})", C, 400, "repetition_penalty", "repetition_penalty must be > 0"},
      {R"({"prompt": "x", "seed": "abc"})", C, 400, "seed", "seed must be an integer"},
      {R"({"prompt": "x", "seed": 1.5})", C, 400, "seed", "seed must be an integer"},
      {R"({"prompt": "x", "stop": 5})", C, 400, "stop", "stop must be a string or a list"},
      {R"({"prompt": "x", "stop": ["a", 5]})", C, 400, "stop", "stop must be a string or a list"},
      {R"({"prompt": "x", "stop": [""]})", C, 400, "stop", "empty stop strings"},
      {R"({"prompt": "x", "stop_token_ids": 5})", C, 400, "stop_token_ids", "list of token ids"},
      {R"({"prompt": "x", "stop_token_ids": [-1]})", C, 400, "stop_token_ids", "out of range"},
      {R"({"prompt": "x", "ignore_eos": "yes"})", C, 400, "ignore_eos", "true or false"},
      {R"({"prompt": "x", "n": 0})", C, 400, "n", "n must be in [1, 16]"},
      {R"({"prompt": "x", "n": 17})", C, 400, "n", "n must be in [1, 16]"},
      {R"({"prompt": ["a", "b", "c", "d", "e"], "n": 16})", C, 400, "n", "must be at most 64"},
      {R"({"prompt": "x", "stream": 1})", C, 400, "stream", "true or false"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", C, 400, "stream_options", "only allowed with"},
      {R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})", C, 400,
       "stream_options.include_usage", "true or false"},
      {R"({"prompt": "x", "logprobs": 21})", C, 400, "logprobs", "logprobs must be in [0, 20]"},
      {R"({"prompt": "x", "logprobs": true})", C, 400, "logprobs", "must be an integer"},
      {R"({"prompt": "x", "echo": true, "logprobs": 1})", C, 400, "echo", "prompt's logprobs"},
      {R"({"prompt": "x", "logit_bias": [1]})", C, 400, "logit_bias", "must be an object"},
      {R"({"prompt": "x", "logit_bias": {"abc": 1}})", C, 400, "logit_bias", "keys must be token ids"},
      {R"({"prompt": "x", "logit_bias": {"-1": 1}})", C, 400, "logit_bias", "keys must be token ids"},
      {R"({"prompt": "x", "logit_bias": {"99999999999": 1}})", C, 400, "logit_bias", "keys must be token ids"},
      {R"({"prompt": "x", "logit_bias": {"5": 101}})", C, 400, "logit_bias", "[-100, 100]"},
      {R"({"prompt": "x", "logit_bias": {"5": "up"}})", C, 400, "logit_bias", "must be a number"},
      {R"({"prompt": "x", "user": 5})", C, 400, "user", "user must be a string"},
      {R"({"prompt": "x", "best_of": 3})", C, 400, "best_of", "not supported"},
      {R"({"prompt": "x", "suffix": "tail"})", C, 400, "suffix", "not supported"},
      {R"({"prompt": "x", "prompt_logprobs": 1})", C, 400, "prompt_logprobs", "not supported"},
      {R"({"prompt": "x", "response_format": {"type": "json_object"}})", C, 400, "response_format", "not supported"},
      {R"({"prompt": "x", "guided_json": {}})", C, 400, "guided_json", "not supported"},
      {R"({"prompt": "x", "use_beam_search": true})", C, 400, "use_beam_search", "not supported"},
      {R"({"prompt": "x", "max_token": 5})", C, 400, "max_token", "unknown parameter \"max_token\""},
      {R"({"prompt": "x", "messages": []})", C, 400, "messages", "unknown parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "prompt": "x"})", H, 400, "prompt", "unknown parameter"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", H, 400, "top_logprobs",
       "needs \"logprobs\": true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 2})", H, 400, "logprobs", "true or false"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 50})", H, 400,
       "top_logprobs", "[0, 20]"},
      {R"({})", H, 400, "messages", "messages is required"},
      {R"({"messages": []})", H, 400, "messages", "at least one message"},
      {R"({"messages": "hi"})", H, 400, "messages", "must be a list"},
      {R"({"messages": ["hi"]})", H, 400, "messages[0]", "must be an object"},
      {R"({"messages": [{"content": "hi"}]})", H, 400, "messages[0].role", "role must be a non-empty string"},
      {R"({"messages": [{"role": 1, "content": "hi"}]})", H, 400, "messages[0].role", "role must be"},
      {R"({"messages": [{"role": "user", "content": 5}]})", H, 400, "messages[0].content", "must be a string"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})", H, 400,
       "messages[0].content", "not supported"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", H, 400, "messages[0].content",
       "string \"text\""},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": []})", H, 400, "tool_choice",
       "not supported"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})", H, 400, "tools", "must be a list"},
      {R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": true, "continue_final_message": true})",
       H, 400, "continue_final_message", "cannot both be true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"})", H, 400, "chat_template",
       "not supported"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.body);
    ApiError e = parse_err(c.body, c.api);
    EXPECT_EQ(e.status, c.status);
    EXPECT_EQ(e.param, c.param);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_NE(e.message.find(c.message_has), std::string::npos) << e.message;
  }
}

TEST(Protocol, StopLimitsRefuseHostileLists) {
  json many = {{"prompt", "x"}, {"stop", json::array()}};
  for (int i = 0; i < 10000; ++i) many["stop"].push_back("s" + std::to_string(i));
  ApiError e = parse_err(many.dump());
  EXPECT_EQ(e.param, "stop");
  EXPECT_NE(e.message.find("at most 64 stop strings, got 10000"), std::string::npos) << e.message;
  json longstop = {{"prompt", "x"}, {"stop", std::string(5000, 'a')}};
  EXPECT_EQ(parse_err(longstop.dump()).param, "stop");
  json ids = {{"prompt", "x"}, {"stop_token_ids", std::vector<int>(2000, 1)}};
  EXPECT_EQ(parse_err(ids.dump()).param, "stop_token_ids");
}

TEST(Protocol, DeeplyNestedJsonIsRefusedWithoutCrashing) {
  const std::string deep = "{\"prompt\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  ApiError e = parse_err(deep);
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(e.message.find("nested 200001 levels deep"), std::string::npos) << e.message;
  // brackets inside strings do not count
  parse_ok(R"({"prompt": ")" + std::string(1000, '[') + R"("})");
}

TEST(Protocol, ErrorJsonIsOpenAIs) {
  json j = error_json(invalid_param("top_p", "top_p must be in (0, 1], got 2"));
  EXPECT_EQ(j.dump(), R"({"error":{"message":"top_p must be in (0, 1], got 2","type":"invalid_request_error","param":"top_p","code":null}})");
  ApiError e = invalid_param("", "bad");
  e.code = "x";
  EXPECT_TRUE(error_json(e)["error"]["param"].is_null());
  EXPECT_EQ(error_json(e)["error"]["code"], "x");
}

TEST(Protocol, EngineRefusalsMapToStatuses) {
  using R = AsyncEngine::Refusal;
  using K = AsyncEngine::SubmitError;
  ApiError full = refusal_error(R{K::queue_full, "3 requests are already waiting (--max-queue 3)"}, false);
  EXPECT_EQ(full.status, 429);
  EXPECT_EQ(full.code, "queue_full");
  EXPECT_EQ(refusal_error(R{K::shutting_down, "the server is shutting down"}, false).status, 503);
  ApiError top_p = refusal_error(R{K::invalid, "top_p must be in (0, 1], got 1.5"}, false);
  EXPECT_EQ(top_p.status, 400);
  EXPECT_EQ(top_p.param, "top_p");
  ApiError bias = refusal_error(R{K::invalid, "logit_bias: token id 70000 outside the vocabulary of 4096"}, false);
  EXPECT_EQ(bias.param, "logit_bias");
  ApiError ctx = refusal_error(
      R{K::invalid, "prompt (900 tokens) + max_tokens (200) = 1100 exceeds the context of 1024 tokens"}, true);
  EXPECT_EQ(ctx.status, 400);
  EXPECT_EQ(ctx.code, "context_length_exceeded");
  EXPECT_EQ(ctx.param, "max_tokens");
  ApiError vocab = refusal_error(R{K::invalid, "prompt token id 5000 outside the vocabulary of 4096"}, true);
  EXPECT_EQ(vocab.param, "messages");
}

struct Nano {
  Tokenizer tokenizer;
  std::optional<ChatTemplate> tmpl;
  ModelInfo info;
};

Nano& nano() {
  static Nano n = [] {
    Nano x;
    auto t = Tokenizer::load(kModel);
    EXPECT_TRUE(t.ok());
    x.tokenizer = std::move(t).value();
    auto p = ChatTemplate::parse(x.tokenizer.chat_template());
    EXPECT_TRUE(p.ok());
    x.tmpl = std::move(p).value();
    return x;
  }();
  n.info.tokenizer = &n.tokenizer;
  n.info.chat_template = &*n.tmpl;
  n.info.eos_token_ids = {*n.tokenizer.eos_id()};
  n.info.max_model_len = 64;
  n.info.vocab_size = n.tokenizer.vocab_size();
  return n;
}

PreparedRequest prepare_ok(const std::string& body, Api api = Api::completions) {
  auto p = prepare(parse_ok(body, api), nano().info);
  if (auto* e = std::get_if<ApiError>(&p)) {
    ADD_FAILURE() << body << " -> " << e->message;
    return {};
  }
  return std::get<PreparedRequest>(p);
}

ApiError prepare_err(const std::string& body, Api api = Api::completions) {
  auto p = prepare(parse_ok(body, api), nano().info);
  if (!std::holds_alternative<ApiError>(p)) {
    ADD_FAILURE() << body << " was accepted";
    return {};
  }
  return std::get<ApiError>(p);
}

TEST(Prepare, TextPromptsGetBosIdsAreTakenAsGiven) {
  const Tokenizer& tok = nano().tokenizer;
  PreparedRequest p = prepare_ok(R"({"prompt": "A computer is", "max_tokens": 5})");
  ASSERT_EQ(p.requests.size(), 1u);
  std::vector<int32_t> want = {*tok.bos_id()};
  for (int32_t id : tok.encode("A computer is")) want.push_back(id);
  EXPECT_EQ(p.requests[0].prompt, want);
  EXPECT_EQ(p.prompt_tokens[0], static_cast<int64_t>(want.size()));
  EXPECT_EQ(p.requests[0].stop.eos_token_ids, std::vector<int32_t>{*tok.eos_id()});
  EXPECT_EQ(prepare_ok(R"({"prompt": "A computer is", "add_special_tokens": false, "max_tokens": 5})").requests[0].prompt,
            tok.encode("A computer is"));
  EXPECT_EQ(prepare_ok(R"({"prompt": [7, 8, 9], "max_tokens": 5})").requests[0].prompt, (std::vector<int32_t>{7, 8, 9}));
}

TEST(Prepare, MaxTokensDefaultsToTheRestOfTheContext) {
  PreparedRequest p = prepare_ok(R"({"prompt": [1, 2, 3, 4]})");
  EXPECT_EQ(p.requests[0].stop.max_tokens, 60);  // 64 - 4
}

TEST(Prepare, TooLongPromptsNameBothNumbers) {
  ApiError e = prepare_err(R"({"prompt": [1, 2, 3, 4], "max_tokens": 61})");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_NE(e.message.find("prompt (4 tokens) + max_tokens (61) = 65 exceeds the context of 64 tokens"), std::string::npos)
      << e.message;
  json full = {{"prompt", std::vector<int>(64, 5)}};
  ApiError f = prepare_err(full.dump());
  EXPECT_EQ(f.code, "context_length_exceeded");
  EXPECT_NE(f.message.find("64 tokens; the context holds 64"), std::string::npos) << f.message;
}

TEST(Prepare, PromptIdsOutsideTheVocabularyAreRefused) {
  ApiError e = prepare_err(R"({"prompt": [1, 4096], "max_tokens": 2})");
  EXPECT_EQ(e.param, "prompt");
  EXPECT_NE(e.message.find("4096 outside the vocabulary of 4096"), std::string::npos);
  EXPECT_EQ(prepare_err(R"({"prompt": "", "add_special_tokens": false, "max_tokens": 2})").param, "prompt");
}

TEST(Prepare, ChoicesFanOutWithDistinctSeeds) {
  PreparedRequest p = prepare_ok(R"({"prompt": ["a", "b"], "n": 3, "seed": 10, "max_tokens": 4})");
  ASSERT_EQ(p.requests.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(p.requests[i].sampling.seed, 10u + static_cast<uint64_t>(i % 3)) << i;
  EXPECT_EQ(p.requests[0].prompt, p.requests[2].prompt);
  EXPECT_NE(p.requests[0].prompt, p.requests[3].prompt);
  EXPECT_EQ(p.prompt_tokens.size(), 2u);
}

TEST(Prepare, StopConditionsAndEcho) {
  PreparedRequest p = prepare_ok(
      R"({"prompt": "hi", "echo": true, "stop": "x", "stop_token_ids": [3], "min_tokens": 1, "ignore_eos": true, "max_tokens": 5})");
  const StopConditions& s = p.requests[0].stop;
  EXPECT_EQ(s.stop_strings, std::vector<std::string>{"x"});
  EXPECT_EQ(s.stop_token_ids, std::vector<int32_t>{3});
  EXPECT_EQ(s.min_tokens, 1);
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_EQ(p.echo[0], "hi");
  EXPECT_EQ(prepare_ok(R"({"prompt": [65, 66], "echo": true, "max_tokens": 5})").echo[0],
            nano().tokenizer.decode({65, 66}));
}

TEST(Prepare, ChatRendersTheModelsTemplate) {
  const Tokenizer& tok = nano().tokenizer;
  PreparedRequest p = prepare_ok(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "max_tokens": 3})", Api::chat);
  EXPECT_EQ(p.requests[0].prompt, tok.encode("<|bos|><|system|>S<|eos|><|user|>U<|eos|><|assistant|>"));
  PreparedRequest no_gen = prepare_ok(
      R"({"messages": [{"role": "user", "content": "U"}], "add_generation_prompt": false, "max_tokens": 3})", Api::chat);
  EXPECT_EQ(no_gen.requests[0].prompt, tok.encode("<|bos|><|user|>U<|eos|>"));
  PreparedRequest cont = prepare_ok(
      R"({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "Once"}],
          "continue_final_message": true, "max_tokens": 3})",
      Api::chat);
  EXPECT_EQ(cont.requests[0].prompt, tok.encode("<|bos|><|user|>U<|eos|><|assistant|>Once"));
}

TEST(Prepare, ChatWithoutATemplateIsRefused) {
  ModelInfo info = nano().info;
  info.chat_template = nullptr;
  auto p = prepare(parse_ok(R"({"messages": [{"role": "user", "content": "U"}]})", Api::chat), info);
  ASSERT_TRUE(std::holds_alternative<ApiError>(p));
  EXPECT_NE(std::get<ApiError>(p).message.find("no chat template"), std::string::npos);
}

TEST(Tokenize, VllmShapes) {
  auto t = tokenize(R"({"prompt": "A computer is"})", nano().info);
  ASSERT_TRUE(std::holds_alternative<json>(t));
  const json& j = std::get<json>(t);
  EXPECT_EQ(j["count"], j["tokens"].size());
  EXPECT_EQ(j["max_model_len"], 64);
  EXPECT_EQ(j["tokens"][0], *nano().tokenizer.bos_id());
  EXPECT_TRUE(j["token_strs"].is_null());
  auto chat = tokenize(R"({"messages": [{"role": "user", "content": "U"}], "return_token_strs": true})", nano().info);
  ASSERT_TRUE(std::holds_alternative<json>(chat));
  EXPECT_EQ(std::get<json>(chat)["token_strs"].size(), std::get<json>(chat)["tokens"].size());
  auto d = detokenize(R"({"tokens": [65, 66, 67]})", nano().info);
  ASSERT_TRUE(std::holds_alternative<json>(d));
  EXPECT_EQ(std::get<json>(d)["prompt"], nano().tokenizer.decode({65, 66, 67}));
  EXPECT_EQ(std::get<ApiError>(detokenize(R"({"tokens": [99999]})", nano().info)).param, "tokens");
  EXPECT_EQ(std::get<ApiError>(detokenize(R"({"tokens": "abc"})", nano().info)).param, "tokens");
  EXPECT_EQ(std::get<ApiError>(tokenize(R"({"prompt": 5})", nano().info)).param, "prompt");
  EXPECT_EQ(std::get<ApiError>(tokenize(R"({)", nano().info)).status, 400);
}

TEST(Protocol, TokenTextMarksBrokenUtf8) {
  const Tokenizer& tok = nano().tokenizer;
  int broken = -1;
  for (int32_t id = 0; id < tok.vocab_size() && broken < 0; ++id) {
    const std::string b = tok.token_bytes(id);
    if (b.size() == 1 && static_cast<unsigned char>(b[0]) >= 0x80) broken = id;
  }
  ASSERT_GE(broken, 0) << "a byte-level vocabulary has lone high bytes";
  EXPECT_EQ(token_text(tok, broken).rfind("bytes:\\x", 0), 0u) << token_text(tok, broken);
  const int32_t a = tok.encode("a")[0];
  EXPECT_EQ(token_text(tok, a), "a");
}

TEST(Metrics, RendersPrometheusText) {
  ServerMetrics m("k3 \"nano\"");
  FinishedRequest f;
  f.reason = FinishReason::length;
  f.ttft_s = 0.03;
  f.itl_s = {0.02, 0.02};
  f.e2e_s = 0.1;
  f.prompt_tokens = 5;
  f.generation_tokens = 3;
  m.record(f);
  m.record_http(200);
  EngineSnapshot snap;
  snap.kv_blocks_used = 3;
  snap.kv_blocks_total = 12;
  snap.prefix_block_lookups = 4;
  snap.prefix_block_hits = 1;
  const std::string text = m.render(snap);
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? [-+0-9.eEinfNa]+$)");
  std::istringstream lines(text);
  std::string line;
  int samples = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
    ++samples;
  }
  EXPECT_GT(samples, 50);
  EXPECT_NE(text.find("moat:kv_cache_usage_perc{model_name=\"k3 \\\"nano\\\"\"} 0.25"), std::string::npos) << text;
  EXPECT_NE(text.find("moat:prefix_cache_hit_rate{model_name=\"k3 \\\"nano\\\"\"} 0.25"), std::string::npos);
  EXPECT_NE(text.find("finished_reason=\"length\"} 1"), std::string::npos);
  EXPECT_NE(text.find("moat:time_to_first_token_seconds_bucket{model_name=\"k3 \\\"nano\\\"\",le=\"0.04\"} 1"),
            std::string::npos);
  EXPECT_NE(text.find("moat:time_to_first_token_seconds_bucket{model_name=\"k3 \\\"nano\\\"\",le=\"0.02\"} 0"),
            std::string::npos);
  EXPECT_NE(text.find("moat:inter_token_latency_seconds_count{model_name=\"k3 \\\"nano\\\"\"} 2"), std::string::npos);
  EXPECT_NE(text.find("# TYPE moat:e2e_request_latency_seconds histogram"), std::string::npos);
}

}  // namespace
}  // namespace moat::server
