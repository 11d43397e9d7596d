#include "bench/calibrate.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace moat::bench {

namespace {

using nlohmann::json;

// Long enough that the mix of words averages out, short enough to cost nothing to prefill.
constexpr int64_t kCalibrationWords[2] = {64, 320};

// The server's token count for a text by POST /tokenize; an error when it has none. vLLM reads
// "prompt" and answers {"count", "tokens"}; llama-server reads "content" and answers {"tokens"}.
Result<int64_t> tokenize_count(const EndpointConfig& endpoint, const std::string& text) {
  MOAT_ASSIGN_OR_RETURN(ParsedUrl url, parse_base_url(endpoint.base_url));
  httplib::Client cli(url.scheme_host_port);
  cli.set_connection_timeout(10);
  cli.set_read_timeout(60);
  httplib::Headers headers;
  if (!endpoint.api_key.empty()) headers.emplace("Authorization", "Bearer " + endpoint.api_key);
  json body = {{"prompt", text}, {"content", text}, {"add_special_tokens", false}};
  if (!endpoint.model.empty()) body["model"] = endpoint.model;
  auto res = cli.Post(url.prefix + "/tokenize", headers, body.dump(), "application/json");
  if (!res) return make_error("POST /tokenize: {}", httplib::to_string(res.error()));
  if (res->status != 200) return make_error("POST /tokenize: HTTP {}", res->status);
  json j = json::parse(res->body, nullptr, false);
  if (j.is_object() && j.contains("count") && j["count"].is_number_integer())
    return j["count"].get<int64_t>();
  if (j.is_object() && j.contains("tokens") && j["tokens"].is_array())
    return static_cast<int64_t>(j["tokens"].size());
  return make_error("POST /tokenize: expected {{\"tokens\": [...]}} or {{\"count\": N}}");
}

// usage.prompt_tokens of a one-token request with this prompt; an error when the server sends none.
Result<int64_t> usage_count(StreamingClient& client, const BenchRequest& prompt) {
  BenchRequest r = prompt;
  r.output_tokens = 1;
  RequestRecord rec = client.send(r, nullptr);
  if (!rec.success && rec.prompt_tokens < 0)
    return make_error("a one-token request failed: {}", rec.error);
  if (rec.prompt_tokens < 0) return make_error("the response carries no usage.prompt_tokens");
  return rec.prompt_tokens;
}

}  // namespace

Result<PromptCalibration> calibrate_word_prompts(const EndpointConfig& endpoint, uint64_t seed) {
  // Words of their own, so that no measured prompt shares a prefix the calibration cached.
  auto prompts = approximate_prompts(
      {{kCalibrationWords[0], 1}, {kCalibrationWords[1], 1}}, seed ^ 0xca11b4a7e5ull);
  PromptCalibration c;
  auto first = tokenize_count(endpoint, prompts[0].prompt);
  if (first.ok()) {
    MOAT_ASSIGN_OR_RETURN(int64_t second, tokenize_count(endpoint, prompts[1].prompt));
    c.method = "POST /tokenize";
    c.tokens[0] = *first;
    c.tokens[1] = second;
  } else {
    MOAT_ASSIGN_OR_RETURN(auto client, StreamingClient::create(endpoint));
    auto a = usage_count(*client, prompts[0]);
    if (!a.ok())
      return make_error("the server has no usable /tokenize ({}) and {}", first.error().message,
                        a.error().message);
    MOAT_ASSIGN_OR_RETURN(int64_t b, usage_count(*client, prompts[1]));
    c.method = "usage.prompt_tokens";
    c.tokens[0] = *a;
    c.tokens[1] = b;
  }
  c.words[0] = kCalibrationWords[0];
  c.words[1] = kCalibrationWords[1];
  c.tokens_per_word = static_cast<double>(c.tokens[1] - c.tokens[0]) /
                      static_cast<double>(c.words[1] - c.words[0]);
  if (!(c.tokens_per_word > 0))
    return make_error("{}: the server counted {} tokens for {} words and {} for {}; expected more "
                      "tokens for more words",
                      c.method, c.tokens[0], c.words[0], c.tokens[1], c.words[1]);
  c.added_tokens = static_cast<double>(c.tokens[0]) - c.tokens_per_word * static_cast<double>(c.words[0]);
  return c;
}

std::string describe(const PromptCalibration& c, int64_t input_len) {
  std::string s = fmt::format(
      "prompt lengths calibrated on the server ({}): {} words -> {} tokens, {} words -> {} "
      "tokens: {:.2f} tokens per word, so prompts of {} tokens are {} words",
      c.method, c.words[0], c.tokens[0], c.words[1], c.tokens[1], c.tokens_per_word, input_len,
      words_for_tokens(input_len, c.tokens_per_word));
  if (long added = std::lround(c.added_tokens); added != 0)
    s += fmt::format(" (the server adds about {} token{} per request: BOS, chat template)", added,
                     added == 1 ? "" : "s");
  return s;
}

}  // namespace moat::bench
