// moat serve end to end, in process: the OpenAI server on 127.0.0.1 (a free port) over an
// AsyncEngine running models/k3-nano with exact activations, spoken to with httplib::Client.
// No assertion depends on machine speed: tests wait for conditions with generous timeouts, and
// requests that must still be running when the client leaves ask for thousands of tokens.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <regex>
#include <set>
#include <thread>

#include "engine/async_engine.h"
#include "server/protocol.h"
#include "server/server.h"
#include "k3_nano_model.h"
#include "server_fixture.h"

namespace moat::server {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
const std::filesystem::path kModel = std::filesystem::path(MOAT_SOURCE_DIR) / "models/k3-nano";
constexpr int64_t kContext = 16384;  // long enough that a 16k-token request outlasts any client action

using testing::Model;
std::unique_ptr<Model> load_model() { return testing::load_k3_nano(kContext); }

ModelInfo info_of(Model& m) {
  ModelInfo info;
  info.tokenizer = &m.tokenizer;
  info.chat_template = &*m.tmpl;
  info.eos_token_ids = {*m.tokenizer.eos_id()};
  info.max_model_len = kContext;
  info.vocab_size = m.model->config().vocab_size;
  return info;
}

// A server with its own model instance (the engine thread owns a model while it runs).
struct TestServer {
  std::unique_ptr<Model> model = load_model();
  std::unique_ptr<AsyncEngine> engine;
  std::unique_ptr<OpenAIServer> server;
  std::thread thread;

  explicit TestServer(ServerOptions o = {}, AsyncEngine::Options eo = {}, int32_t max_num_seqs = 16,
                      SpeculativeConfig speculative = {}) {
    auto e = Engine::create(*model->model,
                            {.kv_memory_bytes = 48 << 20, .max_model_len = kContext, .max_num_seqs = max_num_seqs,
                             .speculative = speculative},
                            &model->tokenizer);
    EXPECT_TRUE(e.ok()) << (e.ok() ? "" : e.error().message);
    engine = std::make_unique<AsyncEngine>(std::move(e).value(), eo);
    o.host = "127.0.0.1";
    o.port = 0;
    if (o.served_model_name.empty()) o.served_model_name = "k3-nano-test";
    o.model_aliases = {"k3-nano"};
    o.access_log = false;
    server = std::make_unique<OpenAIServer>(o);
    EXPECT_TRUE(server->bind().ok());
    thread = std::thread([this] { server->serve(); });
    server->attach({.engine = engine.get(), .info = info_of(*model), .root = kModel.string()});
  }
  ~TestServer() {
    engine->shutdown(false);
    server->stop();
    thread.join();
  }
  std::unique_ptr<httplib::Client> client(int read_timeout_s = 120) const {
    return testing::make_client(*server, read_timeout_s, 10);
  }
  // Waits (up to a minute) until the engine holds no request and no KV block.
  bool wait_engine_idle() const { return testing::wait_engine_idle(*engine, *server, std::chrono::minutes(1)); }
};

TestServer& main_server() {
  static TestServer* s = [] {
    ServerOptions o;
    o.max_body_bytes = 1 << 20;
    return new TestServer(o);
  }();
  return *s;
}

// Greedy tokens and text straight from an Engine on a model instance of its own.
struct Expected {
  std::vector<int32_t> tokens;
  std::string text;
  int64_t prompt_tokens = 0;
  FinishReason reason = FinishReason::none;
};

Expected engine_generate(std::vector<int32_t> prompt, int64_t max_tokens, std::vector<std::string> stop = {}) {
  static std::unique_ptr<Model> m = load_model();
  static std::mutex mu;
  std::lock_guard lock(mu);
  auto e = Engine::create(*m->model, {.kv_memory_bytes = 16 << 20, .max_model_len = kContext}, &m->tokenizer);
  EXPECT_TRUE(e.ok());
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.stop.max_tokens = max_tokens;
  r.stop.eos_token_ids = {*m->tokenizer.eos_id()};
  r.stop.stop_strings = std::move(stop);
  EXPECT_TRUE((*e)->add_request(r).ok());
  Expected x;
  x.prompt_tokens = static_cast<int64_t>(r.prompt.size());
  while ((*e)->has_work())
    for (RequestOutput& out : (*e)->step()) {
      x.tokens.insert(x.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
      x.text += out.text;
      if (out.finished) x.reason = out.finish_reason;
    }
  return x;
}

std::vector<int32_t> bos_encode(const std::string& text) {
  const Tokenizer& t = main_server().model->tokenizer;
  std::vector<int32_t> ids = {*t.bos_id()};
  for (int32_t id : t.encode(text)) ids.push_back(id);
  return ids;
}

json post_json(httplib::Client& c, const std::string& path, const json& body, int* status = nullptr,
               httplib::Headers headers = {}) {
  auto res = c.Post(path, headers, body.dump(), "application/json");
  if (!res) {
    ADD_FAILURE() << path << ": " << httplib::to_string(res.error());
    return {};
  }
  if (status) *status = res->status;
  json j = json::parse(res->body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << res->body;
  return j;
}

struct Sse {
  std::vector<json> chunks;
  bool done = false;
  bool after_done = false;  // anything after [DONE]
  int status = 0;
  std::string content_type;
};

// Reads an SSE response; `stop_after` > 0 closes the connection after that many events.
Sse post_stream(httplib::Client& c, const std::string& path, const json& body, int stop_after = 0) {
  Sse out;
  std::string buf;
  int events = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    out.status = r.status;
    out.content_type = r.get_header_value("Content-Type");
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buf.append(data, n);
    for (size_t p; (p = buf.find("\n\n")) != std::string::npos;) {
      std::string event = buf.substr(0, p);
      buf.erase(0, p + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      std::string data_part = event.substr(6);
      if (out.done) out.after_done = true;
      if (data_part == "[DONE]") out.done = true;
      else out.chunks.push_back(json::parse(data_part, nullptr, false));
      if (stop_after > 0 && ++events >= stop_after) return false;
    }
    return true;
  };
  auto res = c.send(req);
  if (res) out.status = res->status;
  return out;
}

std::string stream_text(const Sse& s, bool chat, int index = 0) {
  std::string text;
  for (const json& c : s.chunks) {
    if (!c.contains("choices")) continue;
    for (const json& ch : c["choices"]) {
      if (ch["index"] != index) continue;
      if (chat) {
        if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
      } else {
        text += ch["text"].get<std::string>();
      }
    }
  }
  return text;
}

void expect_error(const json& body, int status, int want_status, const std::string& message_has, const std::string& code = "") {
  EXPECT_EQ(status, want_status) << body.dump();
  ASSERT_TRUE(body.contains("error")) << body.dump();
  const json& e = body["error"];
  for (const char* key : {"message", "type", "param", "code"}) EXPECT_TRUE(e.contains(key)) << key << ": " << body.dump();
  EXPECT_NE(e["message"].get<std::string>().find(message_has), std::string::npos) << body.dump();
  if (!code.empty()) {
    EXPECT_EQ(e["code"], code) << body.dump();
  }
}

// A plain request that must succeed: the server still serves after whatever came before.
void expect_serves(TestServer& s) {
  auto c = s.client();
  int status = 0;
  json r = post_json(*c, "/v1/completions", {{"prompt", "A computer is"}, {"max_tokens", 3}, {"temperature", 0}}, &status);
  EXPECT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["usage"]["completion_tokens"], 3);
}

TEST(Server, HealthAndModels) {
  auto c = main_server().client();
  auto h = c->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = c->Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], "k3-nano-test");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["max_model_len"], kContext);
}

TEST(Server, HealthIs503UntilTheModelIsAttached) {
  OpenAIServer s({.host = "127.0.0.1", .port = 0, .served_model_name = "later", .access_log = false});
  ASSERT_TRUE(s.bind().ok());
  std::thread t([&] { s.serve(); });
  httplib::Client c("127.0.0.1", s.port());
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  int status = 0;
  json r = post_json(c, "/v1/completions", {{"prompt", "x"}}, &status);
  expect_error(r, status, 503, "loading", "loading");
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200) << "metrics answer while loading";
  s.stop();
  t.join();
}

TEST(Server, GreedyCompletionEqualsTheEngine) {
  const Expected want = engine_generate(bos_encode("The meaning of life is"), 24);
  auto c = main_server().client();
  int status = 0;
  json r = post_json(*c, "/v1/completions",
                     {{"model", "k3-nano-test"}, {"prompt", "The meaning of life is"}, {"max_tokens", 24}, {"temperature", 0}},
                     &status);
  ASSERT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(r["model"], "k3-nano-test");
  ASSERT_EQ(r["choices"].size(), 1u);
  EXPECT_EQ(r["choices"][0]["text"], want.text);
  EXPECT_EQ(r["choices"][0]["finish_reason"], finish_reason_name(want.reason));
  EXPECT_EQ(r["usage"]["prompt_tokens"], want.prompt_tokens);
  EXPECT_EQ(r["usage"]["completion_tokens"], static_cast<int64_t>(want.tokens.size()));
  EXPECT_EQ(r["usage"]["total_tokens"], want.prompt_tokens + static_cast<int64_t>(want.tokens.size()));
  EXPECT_TRUE(r["usage"]["prompt_tokens_details"]["cached_tokens"].is_number_integer());

  // The same prompt as token ids, and under the model directory's name.
  json ids = post_json(*c, "/v1/completions",
                       {{"model", "k3-nano"}, {"prompt", bos_encode("The meaning of life is")}, {"max_tokens", 24}, {"temperature", 0}},
                       &status);
  ASSERT_EQ(status, 200) << ids.dump();
  EXPECT_EQ(ids["choices"][0]["text"], want.text);
}

TEST(Server, StreamingCompletionMatchesNonStreaming) {
  auto c = main_server().client();
  json body = {{"prompt", "A computer is"}, {"max_tokens", 20}, {"temperature", 0}, {"ignore_eos", true}};
  json whole = post_json(*c, "/v1/completions", body);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Sse s = post_stream(*c, "/v1/completions", body);
  EXPECT_EQ(s.status, 200);
  EXPECT_EQ(s.content_type.rfind("text/event-stream", 0), 0u) << s.content_type;
  EXPECT_TRUE(s.done);
  EXPECT_FALSE(s.after_done);
  ASSERT_GE(s.chunks.size(), 2u);
  EXPECT_EQ(stream_text(s, false), whole["choices"][0]["text"].get<std::string>());
  const json& last = s.chunks.back();
  EXPECT_TRUE(last["choices"].empty()) << "the usage chunk has no choices";
  EXPECT_EQ(last["usage"]["completion_tokens"], 20);
  EXPECT_EQ(last["usage"]["prompt_tokens"], whole["usage"]["prompt_tokens"]);
  const json& fin = s.chunks[s.chunks.size() - 2];
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
  for (size_t i = 0; i + 1 < s.chunks.size(); ++i) {
    EXPECT_EQ(s.chunks[i]["object"], "text_completion");
    EXPECT_EQ(s.chunks[i]["id"], s.chunks[0]["id"]);
    EXPECT_TRUE(s.chunks[i]["usage"].is_null());
  }

  // Without include_usage: no usage chunk.
  body.erase("stream_options");
  Sse plain = post_stream(*c, "/v1/completions", body);
  EXPECT_TRUE(plain.done);
  EXPECT_FALSE(plain.chunks.back()["choices"].empty());
  EXPECT_FALSE(plain.chunks.back().contains("usage"));
}

TEST(Server, ChatStreamingAndNot) {
  TestServer& srv = main_server();
  const json messages = json::array({{{"role", "system"}, {"content", "You are terse."}},
                                     {{"role", "user"}, {"content", "Tell me a fortune."}}});
  auto text = render_chat(info_of(*srv.model), nlohmann::ordered_json::parse(messages.dump()), true);
  ASSERT_TRUE(text.ok());
  const Expected want = engine_generate(srv.model->tokenizer.encode(*text), 16);

  auto c = srv.client();
  int status = 0;
  json r = post_json(*c, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 16}, {"temperature", 0}}, &status);
  ASSERT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], want.text);
  EXPECT_EQ(r["choices"][0]["finish_reason"], finish_reason_name(want.reason));
  EXPECT_EQ(r["usage"]["prompt_tokens"], want.prompt_tokens);

  Sse s = post_stream(*c, "/v1/chat/completions",
                      {{"messages", messages}, {"max_tokens", 16}, {"temperature", 0}, {"stream", true},
                       {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(s.done);
  ASSERT_GE(s.chunks.size(), 3u);
  EXPECT_EQ(s.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(s.chunks[0]["choices"][0]["delta"]["role"], "assistant") << "chat streams open with the role";
  EXPECT_EQ(stream_text(s, true), want.text);
  EXPECT_EQ(s.chunks.back()["usage"]["completion_tokens"], static_cast<int64_t>(want.tokens.size()));
  EXPECT_EQ(s.chunks[s.chunks.size() - 2]["choices"][0]["finish_reason"], finish_reason_name(want.reason));
}

TEST(Server, StopStringsAndStopTokenIds) {
  auto c = main_server().client();
  json body = {{"prompt", "A computer is"}, {"max_tokens", 30}, {"temperature", 0}, {"ignore_eos", true}};
  json full = post_json(*c, "/v1/completions", body);
  const std::string text = full["choices"][0]["text"];
  ASSERT_GE(text.size(), 12u) << text;
  const std::string stop = text.substr(8, 3);
  const std::string before = text.substr(0, text.find(stop));

  body["stop"] = stop;
  json r = post_json(*c, "/v1/completions", body);
  EXPECT_EQ(r["choices"][0]["text"], before);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][0]["stop_reason"], stop);

  body["include_stop_str_in_output"] = true;
  EXPECT_EQ(post_json(*c, "/v1/completions", body)["choices"][0]["text"], before + stop);
  body.erase("include_stop_str_in_output");

  body["stream"] = true;
  Sse s = post_stream(*c, "/v1/completions", body);
  EXPECT_EQ(stream_text(s, false), before) << "streamed text holds back a partial stop string";
  body.erase("stream");
  body.erase("stop");

  // A token id of the greedy output ends the request at its first occurrence.
  const Expected want = engine_generate(bos_encode("A computer is"), 30);
  ASSERT_GE(want.tokens.size(), 4u);
  const int32_t stop_id = want.tokens[3];
  const auto first = std::find(want.tokens.begin(), want.tokens.end(), stop_id) - want.tokens.begin();
  body["stop_token_ids"] = {stop_id};
  json st = post_json(*c, "/v1/completions", body);
  EXPECT_EQ(st["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(st["choices"][0]["stop_reason"], stop_id);
  EXPECT_EQ(st["usage"]["completion_tokens"], first + 1) << "the stop token is counted, as vLLM does";
}

TEST(Server, LogprobsInBothFormats) {
  auto c = main_server().client();
  json r = post_json(*c, "/v1/completions",
                     {{"prompt", "A computer is"}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 3}});
  const json& lp = r["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 5u) << r.dump();
  ASSERT_EQ(lp["token_logprobs"].size(), 5u);
  ASSERT_EQ(lp["top_logprobs"].size(), 5u);
  ASSERT_EQ(lp["text_offset"].size(), 5u);
  std::string joined;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_GE(lp["top_logprobs"][i].size(), 3u);
    EXPECT_LE(lp["top_logprobs"][i].size(), 4u);
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, r["choices"][0]["text"]);

  json ch = post_json(*c, "/v1/chat/completions",
                      {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 4}, {"temperature", 0},
                       {"ignore_eos", true}, {"logprobs", true}, {"top_logprobs", 2}});
  const json& content = ch["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u) << ch.dump();
  for (const json& e : content) {
    EXPECT_TRUE(e["token"].is_string());
    EXPECT_TRUE(e["bytes"].is_array());
    EXPECT_EQ(e["top_logprobs"].size(), 2u);
    // greedy: the chosen token is the most likely one
    EXPECT_DOUBLE_EQ(e["logprob"].get<double>(), e["top_logprobs"][0]["logprob"].get<double>());
  }
  json none = post_json(*c, "/v1/chat/completions",
                        {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 2}});
  EXPECT_TRUE(none["choices"][0]["logprobs"].is_null());
}

TEST(Server, SeedsReproduceAndNGivesChoices) {
  auto c = main_server().client();
  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 1.0}, {"seed", 1234}, {"ignore_eos", true}};
  json a = post_json(*c, "/v1/completions", body);
  json b = post_json(*c, "/v1/completions", body);
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
  body["n"] = 3;
  int status = 0;
  json n = post_json(*c, "/v1/completions", body, &status);
  ASSERT_EQ(status, 200) << n.dump();
  ASSERT_EQ(n["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(n["choices"][i]["index"], i);
  // Choices may share a batch with each other, and a batch's float sums may differ in the last
  // bit from a lone request's, so choice 0 need not repeat `a` token for token at temperature 1.
  EXPECT_EQ(n["usage"]["completion_tokens"], 36);
  EXPECT_EQ(n["usage"]["prompt_tokens"], a["usage"]["prompt_tokens"]) << "one prompt counted once";
  body["stream"] = true;
  Sse s = post_stream(*c, "/v1/completions", body);
  ASSERT_TRUE(s.done);
  std::set<int> finished;
  for (const json& ch : s.chunks)
    for (const json& choice : ch["choices"])
      if (!choice["finish_reason"].is_null()) finished.insert(choice["index"].get<int>());
  EXPECT_EQ(finished, (std::set<int>{0, 1, 2}));
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(stream_text(s, false, i).empty()) << i;
  // several prompts
  json many = post_json(*c, "/v1/completions", {{"prompt", {"A computer is", "The meaning of life is"}}, {"max_tokens", 3},
                                                {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(many["choices"].size(), 2u);
  EXPECT_EQ(many["usage"]["completion_tokens"], 6);
}

TEST(Server, EchoPrependsThePrompt) {
  auto c = main_server().client();
  json body = {{"prompt", "A computer is"}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}};
  json plain = post_json(*c, "/v1/completions", body);
  body["echo"] = true;
  json echo = post_json(*c, "/v1/completions", body);
  EXPECT_EQ(echo["choices"][0]["text"], "A computer is" + plain["choices"][0]["text"].get<std::string>());
  body["stream"] = true;
  EXPECT_EQ(stream_text(post_stream(*c, "/v1/completions", body), false), echo["choices"][0]["text"]);
}

TEST(Server, ConcurrentClientsGetTheirGreedyOutputs) {
  const std::vector<std::string> prompts = {"A computer is", "The meaning of life is", "Once upon a time", "Never"};
  std::vector<Expected> want;
  for (const auto& p : prompts) want.push_back(engine_generate(bos_encode(p), 16));
  constexpr int kClients = 16;
  std::vector<std::string> got(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      auto c = main_server().client();
      json body = {{"prompt", prompts[i % prompts.size()]}, {"max_tokens", 16}, {"temperature", 0}};
      if (i % 2) {
        body["stream"] = true;
        got[i] = stream_text(post_stream(*c, "/v1/completions", body), false);
      } else {
        got[i] = post_json(*c, "/v1/completions", body)["choices"][0]["text"];
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(got[i], want[i % prompts.size()].text) << i;
  EXPECT_TRUE(main_server().wait_engine_idle());
}

int64_t metric_value(const std::string& text, const std::string& name_and_labels) {
  size_t p = text.find("\n" + name_and_labels + " ");
  if (p == std::string::npos) return -1;
  p += name_and_labels.size() + 2;
  return static_cast<int64_t>(std::stod(text.substr(p, text.find('\n', p) - p)));
}

std::string metrics_text(TestServer& s) {
  auto r = s.client()->Get("/metrics");
  return r ? r->body : std::string();
}

TEST(Server, StreamingClientThatDisconnectsFreesItsBlocks) {
  TestServer& s = main_server();
  const int64_t gone_before = s.server->metrics().client_disconnects();
  auto c = s.client();
  Sse part = post_stream(*c, "/v1/completions",
                         {{"prompt", "A computer is"}, {"max_tokens", kContext - 100}, {"ignore_eos", true}, {"stream", true}},
                         /*stop_after=*/3);
  EXPECT_EQ(part.chunks.size(), 3u);
  EXPECT_FALSE(part.done);
  c.reset();  // the connection is gone
  EXPECT_TRUE(s.wait_engine_idle()) << "running " << s.engine->snapshot().running << ", blocks "
                                    << s.engine->snapshot().kv_blocks_used;
  EXPECT_EQ(s.server->metrics().client_disconnects(), gone_before + 1);
  const std::string m = metrics_text(s);
  EXPECT_EQ(metric_value(m, "moat:kv_cache_blocks_used{model_name=\"k3-nano-test\"}"), 0);
  EXPECT_EQ(metric_value(m, "moat:num_requests_running{model_name=\"k3-nano-test\"}"), 0);
  expect_serves(s);
}

TEST(Server, NonStreamingClientThatGoesAwayIsAborted) {
  TestServer& s = main_server();
  const int64_t gone_before = s.server->metrics().client_disconnects();
  {
    httplib::Client c("127.0.0.1", s.server->port());
    c.set_read_timeout(0, 300000);  // gives up long before 16k tokens are generated
    auto r = c.Post("/v1/completions",
                    json({{"prompt", "A computer is"}, {"max_tokens", kContext - 100}, {"ignore_eos", true}}).dump(),
                    "application/json");
    EXPECT_FALSE(r) << "the client timed out";
  }
  EXPECT_TRUE(s.wait_engine_idle());
  EXPECT_EQ(s.server->metrics().client_disconnects(), gone_before + 1);
  expect_serves(s);
}

TEST(Server, ErrorsAreOpenAIsAndTheServerGoesOn) {
  TestServer& s = main_server();
  auto c = s.client();
  auto raw = [&](const std::string& path, const std::string& body, int& status) {
    auto r = c->Post(path, body, "application/json");
    EXPECT_TRUE(r);
    status = r ? r->status : 0;
    return r ? json::parse(r->body, nullptr, false) : json();
  };
  int status = 0;
  json malformed = raw("/v1/completions", "{\"prompt\": ", status);
  expect_error(malformed, status, 400, "malformed JSON");
  expect_serves(s);
  json bad = post_json(*c, "/v1/completions", {{"prompt", "x"}, {"top_p", 7}}, &status);
  expect_error(bad, status, 400, "top_p must be in (0, 1]");
  EXPECT_EQ(bad["error"]["param"], "top_p");
  expect_serves(s);
  json huge = post_json(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", kContext}}, &status);
  expect_error(huge, status, 400, fmt::format("max_tokens ({}) = {} exceeds the context of {} tokens", kContext, kContext + 2, kContext),
               "context_length_exceeded");
  json long_prompt = post_json(*c, "/v1/completions", {{"prompt", std::vector<int>(kContext + 5, 65)}}, &status);
  expect_error(long_prompt, status, 400, fmt::format("the prompt has {} tokens; the context holds {}", kContext + 5, kContext),
               "context_length_exceeded");
  json model = post_json(*c, "/v1/chat/completions", {{"model", "gpt-4"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}},
                         &status);
  expect_error(model, status, 404, "`gpt-4` does not exist", "model_not_found");
  auto route = c->Get("/v1/nothing");
  ASSERT_TRUE(route);
  expect_error(json::parse(route->body), route->status, 404, "no route GET /v1/nothing", "not_found");
  auto big = c->Post("/v1/completions", std::string(2 << 20, ' '), "application/json");
  ASSERT_TRUE(big);
  expect_error(json::parse(big->body), big->status, 413, "larger than", "request_too_large");
  // A chunked upload has no Content-Length for httplib to check: the server counts it itself,
  // and reads the rest so that the connection serves its next request.
  httplib::Client chunked("127.0.0.1", s.server->port());
  chunked.set_keep_alive(true);
  const std::string piece(64 << 10, ' ');
  auto up = chunked.Post(
      "/v1/completions",
      [&](size_t offset, httplib::DataSink& sink) {
        if (offset >= (4u << 20)) sink.done();
        else sink.write(piece.data(), piece.size());
        return true;
      },
      "application/json");
  ASSERT_TRUE(up);
  expect_error(json::parse(up->body), up->status, 413, "larger than", "request_too_large");
  auto next = chunked.Post("/v1/completions", R"({"prompt": "A", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 200) << "the same connection goes on";
  auto no_body = c->Post("/v1/completions");
  ASSERT_TRUE(no_body);
  expect_error(json::parse(no_body->body), no_body->status, 400, "malformed JSON");
  json empty = post_json(*c, "/v1/chat/completions", {{"messages", json::array()}}, &status);
  expect_error(empty, status, 400, "at least one message");
  expect_serves(s);
}

TEST(Server, FiftyHostileRequestsEachGetA4xx) {
  TestServer& s = main_server();
  auto c = s.client();
  std::vector<std::pair<std::string, std::string>> bodies;  // (path, body)
  const std::string C = "/v1/completions", H = "/v1/chat/completions";
  for (const char* b : {"", "{", "}", "null", "[]", "\"x\"", "42", "{\"prompt\": }", "{\"prompt\": \"x\"}}",
                        "{\"prompt\": \"\xc3\x28\"}", "{\"prompt\": \"\xff\"}", "{\"prompt\": NaN}", "{'prompt': 'x'}"})
    bodies.emplace_back(C, b);
  for (const char* b : {R"({"prompt": 1})", R"({"prompt": true})", R"({"prompt": [1, "a"]})", R"({"prompt": [-1]})",
                        R"({"prompt": [4096]})", R"({"prompt": [2147483648]})", R"({"prompt": "x", "max_tokens": -1})",
                        R"({"prompt": "x", "max_tokens": 1e20})", R"({"prompt": "x", "max_tokens": 9223372036854775807})",
                        R"({"prompt": "x", "temperature": -1})", R"({"prompt": "x", "temperature": 1e400})",
                        R"({"prompt": "x", "top_k": -5})", R"({"prompt": "x", "n": 1000000})",
                        R"({"prompt": "x", "logprobs": 1000})", R"({"prompt": "x", "logit_bias": {"5000": 5}})",
                        R"({"prompt": "x", "logit_bias": {"x": 5}})", R"({"prompt": "x", "stop_token_ids": [99999]})",
                        R"({"prompt": "x", "min_tokens": 10, "max_tokens": 5})", R"({"prompt": "x", "seed": "s"})",
                        R"({"prompt": "x", "unknown_field": 1})", R"({"prompt": "x", "stream": "yes"})",
                        R"({"prompt": "x", "model": "other"})", R"({"prompt": "", "add_special_tokens": false})"})
    bodies.emplace_back(C, b);
  for (const char* b : {R"({"messages": []})", R"({"messages": null})", R"({"messages": [{}]})",
                        R"({"messages": [{"role": "user"}], "top_logprobs": 3})", R"({"messages": [{"role": ""}]})",
                        R"({"messages": [{"role": "user", "content": {"a": 1}}]})",
                        R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})",
                        R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})",
                        R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
                        R"({"messages": [{"role": "user", "content": "x"}], "temperature": [1]})"})
    bodies.emplace_back(H, b);
  nlohmann::json many_stops = {{"prompt", "x"}, {"stop", nlohmann::json::array()}};
  for (int i = 0; i < 10000; ++i) many_stops["stop"].push_back(std::to_string(i));
  bodies.emplace_back(C, many_stops.dump());
  bodies.emplace_back(C, "{\"prompt\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  bodies.emplace_back(C, std::string(10 << 20, 'x'));  // 10 MB
  bodies.emplace_back("/tokenize", "{\"prompt\": 3}");
  bodies.emplace_back("/detokenize", "{\"tokens\": [\"a\"]}");
  ASSERT_GE(bodies.size(), 50u);
  for (const auto& [path, body] : bodies) {
    SCOPED_TRACE(body.substr(0, 80));
    auto r = c->Post(path, body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_GE(r->status, 400);
    EXPECT_LT(r->status, 500);
    json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
  }
  expect_serves(s);
}

TEST(Server, ApiKeyIsRequiredWhenSet) {
  TestServer s({.api_key = "sekret"});
  auto c = s.client();
  const json body = {{"prompt", "A computer is"}, {"max_tokens", 2}};
  int status = 0;
  json missing = post_json(*c, "/v1/completions", body, &status);
  expect_error(missing, status, 401, "missing API key", "invalid_api_key");
  json wrong = post_json(*c, "/v1/completions", body, &status, {{"Authorization", "Bearer wrong"}});
  expect_error(wrong, status, 401, "invalid API key");
  json longer = post_json(*c, "/v1/completions", body, &status, {{"Authorization", "Bearer sekret-and-more"}});
  expect_error(longer, status, 401, "invalid API key");
  json ok = post_json(*c, "/v1/completions", body, &status, {{"Authorization", "Bearer sekret"}});
  EXPECT_EQ(status, 200) << ok.dump();
  auto models = c->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 401);
  auto health = c->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200) << "/health needs no key";
  auto metrics = c->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200) << "/metrics needs no key";
}

TEST(Server, FullQueueIs429AndShutdownIs503) {
  // max_waiting 0: every submission finds the queue full, whatever the machine's speed.
  TestServer s({}, {.max_waiting = 0});
  auto c = s.client();
  int status = 0;
  json r = post_json(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}}, &status);
  expect_error(r, status, 429, "already waiting (--max-queue 0)", "queue_full");
  auto health = c->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto tok = c->Post("/tokenize", R"({"prompt": "x"})", "application/json");
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->status, 200) << "the server goes on serving";

  s.server->begin_shutdown();
  json down = post_json(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}}, &status);
  expect_error(down, status, 503, "shutting down", "shutting_down");
  health = c->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
}

TEST(Server, ShutdownDrainsInFlightStreams) {
  TestServer s;
  auto c = s.client();
  Sse got;
  std::thread client([&] {
    got = post_stream(*c, "/v1/completions",
                      {{"prompt", "A computer is"}, {"max_tokens", 64}, {"ignore_eos", true}, {"stream", true}});
  });
  for (int i = 0; i < 6000 && s.server->in_flight() == 0; ++i) std::this_thread::sleep_for(10ms);
  s.server->begin_shutdown();
  s.engine->shutdown(true);  // returns when the request has finished
  EXPECT_TRUE(s.server->wait_idle(60s));
  client.join();
  EXPECT_TRUE(got.done) << "the in-flight stream ran to its end";
  EXPECT_EQ(got.chunks.back()["choices"][0]["finish_reason"], "length");
}

TEST(Server, MetricsParseAndMove) {
  TestServer& s = main_server();
  const std::string label = "{model_name=\"k3-nano-test\"}";
  const std::string before = metrics_text(s);
  expect_serves(s);
  const std::string after = metrics_text(s);
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? [-+0-9.eEinfNa]+$)");
  std::istringstream lines(after);
  std::string line, last_type;
  while (std::getline(lines, line)) {
    if (line.rfind("# TYPE ", 0) == 0) last_type = line.substr(7, line.find(' ', 7) - 7);
    if (line.rfind("#", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
    EXPECT_EQ(line.rfind(last_type, 0), 0u) << "every sample follows its TYPE line: " << line;
  }
  for (const char* name : {"moat:num_requests_running", "moat:num_requests_waiting", "moat:kv_cache_blocks_used",
                           "moat:kv_cache_blocks_total", "moat:prefix_cache_hit_rate", "moat:num_preemptions_total",
                           "moat:prompt_tokens_total", "moat:generation_tokens_total"})
    EXPECT_GE(metric_value(after, name + label), 0) << name;
  EXPECT_GT(metric_value(after, "moat:kv_cache_blocks_total" + label), 0);
  // The engine's counters are published after the step that produced the last token, which
  // may be a moment after the client has its response.
  std::string later = after;
  for (int i = 0; i < 600 && metric_value(later, "moat:generation_tokens_total" + label) <
                                  metric_value(before, "moat:generation_tokens_total" + label) + 3; ++i) {
    std::this_thread::sleep_for(100ms);
    later = metrics_text(s);
  }
  EXPECT_GE(metric_value(later, "moat:generation_tokens_total" + label),
            metric_value(before, "moat:generation_tokens_total" + label) + 3);
  EXPECT_GT(metric_value(after, "moat:prompt_tokens_total" + label), metric_value(before, "moat:prompt_tokens_total" + label));
  EXPECT_EQ(metric_value(after, "moat:time_to_first_token_seconds_count" + label),
            metric_value(before, "moat:time_to_first_token_seconds_count" + label) + 1);
  EXPECT_EQ(metric_value(after, "moat:e2e_request_latency_seconds_count" + label),
            metric_value(before, "moat:e2e_request_latency_seconds_count" + label) + 1);
  const std::string length = "moat:request_success_total{model_name=\"k3-nano-test\",finished_reason=\"length\"}";
  EXPECT_EQ(metric_value(after, length), metric_value(before, length) + 1);
}

TEST(Server, TokenizeAndDetokenize) {
  auto c = main_server().client();
  json t = post_json(*c, "/tokenize", {{"prompt", "A computer is"}});
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), bos_encode("A computer is"));
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_EQ(t["max_model_len"], kContext);
  json d = post_json(*c, "/detokenize", {{"tokens", main_server().model->tokenizer.encode("A computer is")}});
  EXPECT_EQ(d["prompt"], "A computer is");
  json chat = post_json(*c, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}});
  EXPECT_EQ(chat["tokens"].get<std::vector<int32_t>>(),
            main_server().model->tokenizer.encode("<|bos|><|user|>Hi<|eos|><|assistant|>"));
}

}  // namespace
}  // namespace moat::server

namespace moat::server {
namespace {

TEST(Server, SpeculativeServingStreamsTheGreedyTextAndCountsAcceptance) {
  TestServer s({}, {}, 16, {.method = "ngram", .num_tokens = 3});
  const std::vector<std::string> prompts = {"The meaning of life is", "A computer is", "Love is", "Perl is"};
  std::vector<Expected> want;
  for (const auto& p : prompts) want.push_back(engine_generate(bos_encode(p), 24));
  std::vector<std::string> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      auto c = s.client();
      Sse sse = post_stream(*c, "/v1/completions",
                            {{"prompt", bos_encode(prompts[i])}, {"max_tokens", 24}, {"temperature", 0}, {"stream", true}});
      got[i] = stream_text(sse, false);
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], want[i].text) << prompts[i];
  auto c = s.client();
  auto metrics = c->Get("/metrics");
  ASSERT_TRUE(metrics);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(metrics->body, m, std::regex("moat:spec_decode_num_draft_tokens_total\\{[^}]*\\} ([0-9.e+]+)")))
      << metrics->body;
  EXPECT_GT(std::stod(m[1]), 0.0);
  EXPECT_TRUE(s.wait_engine_idle());
}

}  // namespace
}  // namespace moat::server
