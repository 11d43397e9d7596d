// moat serve under load, in process (issue 11, "Tests"): 64 streaming clients at once get exactly
// what they get alone at temperature 0, and 200 streams of which a third are dropped mid-stream
// leave the server serving with no KV block in use. The server runs models/k3-nano with exact
// activations (so greedy decoding does not depend on the batch) over an AsyncEngine, spoken to
// with httplib::Client. No assertion depends on machine speed: idleness is polled for with a
// generous timeout.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <random>
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
constexpr int64_t kContext = 2048;
const std::string kModelName = "k3-nano-load";

using testing::Model;
std::unique_ptr<Model> load_model() { return testing::load_k3_nano(kContext); }

// One server for the whole file: 64 sequences may run in one batch.
struct LoadServer {
  std::unique_ptr<Model> model = load_model();
  std::unique_ptr<AsyncEngine> engine;
  std::unique_ptr<OpenAIServer> server;
  std::thread thread;

  LoadServer() {
    auto e = Engine::create(*model->model, {.kv_memory_bytes = 48 << 20, .max_model_len = kContext, .max_num_seqs = 64},
                            &model->tokenizer);
    EXPECT_TRUE(e.ok()) << (e.ok() ? "" : e.error().message);
    engine = std::make_unique<AsyncEngine>(std::move(e).value(), AsyncEngine::Options{});
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.served_model_name = kModelName;
    o.model_aliases = {"k3-nano"};
    o.access_log = false;
    server = std::make_unique<OpenAIServer>(o);
    EXPECT_TRUE(server->bind().ok());
    thread = std::thread([this] { server->serve(); });
    ModelInfo info;
    info.tokenizer = &model->tokenizer;
    info.chat_template = &*model->tmpl;
    info.eos_token_ids = {*model->tokenizer.eos_id()};
    info.max_model_len = kContext;
    info.vocab_size = model->model->config().vocab_size;
    server->attach({.engine = engine.get(), .info = info, .root = kModel.string()});
  }
  ~LoadServer() {
    engine->shutdown(false);
    server->stop();
    thread.join();
  }
  std::unique_ptr<httplib::Client> client() const { return testing::make_client(*server, 300, 30); }
  // Waits (up to two minutes) until the engine holds no request and no KV block.
  bool wait_engine_idle() const { return testing::wait_engine_idle(*engine, *server, std::chrono::minutes(2)); }
};

LoadServer& load_server() {
  static LoadServer* s = new LoadServer();  // leaked: the engine thread must not outlive its model at exit
  return *s;
}

// One SSE response as read: the parsed data events, whether [DONE] came (and anything after it).
struct Stream {
  int status = 0;
  bool transport_ok = false;  // httplib returned a response (false when we aborted the read)
  std::string error;          // httplib's error when it did not
  std::vector<json> chunks;
  bool done = false;
  bool after_done = false;
  bool bad_event = false;  // a data line that is not JSON, or an event that is not "data: "
  std::string text;
  json usage;
};

// Streams a completion; `stop_after` > 0 closes the connection after that many data events.
Stream stream_completion(httplib::Client& c, const json& body, int stop_after = 0) {
  Stream out;
  std::string buf;
  int events = 0;
  bool aborted = false;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    out.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buf.append(data, n);
    for (size_t p; (p = buf.find("\n\n")) != std::string::npos;) {
      std::string event = buf.substr(0, p);
      buf.erase(0, p + 2);
      if (event.rfind("data: ", 0) != 0) {
        out.bad_event = true;
        continue;
      }
      const std::string data_part = event.substr(6);
      if (out.done) out.after_done = true;
      if (data_part == "[DONE]") {
        out.done = true;
      } else {
        json j = json::parse(data_part, nullptr, false);
        if (j.is_discarded()) out.bad_event = true;
        out.chunks.push_back(std::move(j));
      }
      if (stop_after > 0 && ++events >= stop_after) {
        aborted = true;
        return false;  // aborts the read: the client goes away
      }
    }
    return true;
  };
  auto res = c.send(req);
  out.transport_ok = static_cast<bool>(res);
  if (!res) out.error = httplib::to_string(res.error());
  if (res) out.status = res->status;
  if (!aborted && !buf.empty()) out.bad_event = true;  // a partial event at the end
  for (const json& ch : out.chunks) {
    if (!ch.is_object()) continue;
    if (ch.contains("choices") && ch["choices"].is_array())
      for (const json& choice : ch["choices"])
        if (choice.contains("text") && choice["text"].is_string()) out.text += choice["text"].get<std::string>();
    if (ch.contains("usage") && !ch["usage"].is_null()) out.usage = ch["usage"];
  }
  return out;
}

json stream_body(const std::string& prompt, int max_tokens) {
  return {{"model", kModelName},       {"prompt", prompt},   {"max_tokens", max_tokens},
          {"temperature", 0},          {"ignore_eos", true}, {"stream", true},
          {"stream_options", {{"include_usage", true}}}};
}

// Every chunk well-formed, [DONE] last and once, usage at the end, finish_reason "length".
void expect_complete(const Stream& s, int max_tokens, const std::string& what) {
  EXPECT_TRUE(s.transport_ok) << what << ": " << s.error;
  EXPECT_EQ(s.status, 200) << what;
  EXPECT_FALSE(s.bad_event) << what;
  EXPECT_TRUE(s.done) << what << ": no [DONE]";
  EXPECT_FALSE(s.after_done) << what << ": events after [DONE]";
  ASSERT_FALSE(s.chunks.empty()) << what;
  std::string id;
  std::string finish;
  for (const json& ch : s.chunks) {
    ASSERT_TRUE(ch.is_object()) << what << ": " << ch.dump();
    EXPECT_EQ(ch.value("object", ""), "text_completion") << what << ": " << ch.dump();
    ASSERT_TRUE(ch.contains("id") && ch["id"].is_string()) << what << ": " << ch.dump();
    if (id.empty()) id = ch["id"].get<std::string>();
    EXPECT_EQ(ch["id"], id) << what << ": one id per stream";
    EXPECT_EQ(id.rfind("cmpl-", 0), 0u) << what << ": " << id;
    ASSERT_TRUE(ch.contains("choices") && ch["choices"].is_array()) << what << ": " << ch.dump();
    for (const json& choice : ch["choices"]) {
      EXPECT_EQ(choice.value("index", -1), 0) << what;
      if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
        EXPECT_TRUE(finish.empty()) << what << ": two finish reasons";
        finish = choice["finish_reason"].get<std::string>();
      }
    }
  }
  EXPECT_EQ(finish, "length") << what;
  ASSERT_TRUE(s.usage.is_object()) << what << ": no usage chunk";
  EXPECT_EQ(s.usage.value("completion_tokens", -1), max_tokens) << what;
  EXPECT_GT(s.usage.value("prompt_tokens", 0), 0) << what;
  EXPECT_EQ(s.usage.value("total_tokens", -1), s.usage.value("prompt_tokens", 0) + max_tokens) << what;
}

std::string prompt_of(int i) {
  static const char* kStarts[] = {"A computer is", "The meaning of life is", "Once upon a time", "Never",
                                  "The river",     "In the year",            "My favourite",     "Numbers like"};
  return std::string(kStarts[i % 8]) + " " + std::to_string(i);
}

// Greedy output of each prompt, one request at a time over HTTP.
std::vector<Stream> alone(int count, int max_tokens) {
  std::vector<Stream> out;
  auto c = load_server().client();
  for (int i = 0; i < count; ++i) {
    out.push_back(stream_completion(*c, stream_body(prompt_of(i), max_tokens)));
    expect_complete(out.back(), max_tokens, "alone " + std::to_string(i));
  }
  return out;
}

int64_t metric_value(const std::string& text, const std::string& name_and_labels) {
  size_t p = text.find("\n" + name_and_labels + " ");
  if (p == std::string::npos) return -1;
  p += name_and_labels.size() + 2;
  return static_cast<int64_t>(std::stod(text.substr(p, text.find('\n', p) - p)));
}

void expect_idle_and_serving(LoadServer& s) {
  EXPECT_TRUE(s.wait_engine_idle()) << "running " << s.engine->snapshot().running << ", waiting "
                                    << s.engine->snapshot().waiting << ", blocks " << s.engine->snapshot().kv_blocks_used
                                    << ", in flight " << s.server->in_flight();
  auto c = s.client();
  auto m = c->Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const std::string label = "{model_name=\"" + kModelName + "\"}";
  EXPECT_EQ(metric_value(m->body, "moat:kv_cache_blocks_used" + label), 0) << m->body;
  EXPECT_EQ(metric_value(m->body, "moat:num_requests_running" + label), 0) << m->body;
  EXPECT_EQ(metric_value(m->body, "moat:num_requests_waiting" + label), 0) << m->body;
  // A normal request still gets a normal answer.
  auto r = c->Post("/v1/completions", json({{"prompt", "A computer is"}, {"max_tokens", 4}, {"temperature", 0}}).dump(),
                   "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r->body;
  EXPECT_TRUE(j["choices"][0]["text"].is_string()) << r->body;
  EXPECT_GE(j["usage"]["completion_tokens"].get<int>(), 1) << r->body;
  EXPECT_LE(j["usage"]["completion_tokens"].get<int>(), 4) << r->body;
}

TEST(ServerLoad, SixtyFourStreamingClientsGetWhatTheyGetAlone) {
  constexpr int kClients = 64, kTokens = 16;
  const std::vector<Stream> want = alone(kClients, kTokens);
  std::vector<Stream> got(kClients);
  // All 64 connect and send together: the server listens with a backlog of 1024 (the packaged
  // libcpp-httplib's compiled-in 5 overflowed and dropped connections in a burst like this one).
  std::vector<std::unique_ptr<httplib::Client>> clients;
  for (int i = 0; i < kClients; ++i) clients.push_back(load_server().client());
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < kClients) std::this_thread::yield();  // all 64 connect and send together
      got[i] = stream_completion(*clients[i], stream_body(prompt_of(i), kTokens));
    });
  for (auto& t : threads) t.join();
  clients.clear();
  for (int i = 0; i < kClients; ++i) {
    expect_complete(got[i], kTokens, "client " + std::to_string(i));
    EXPECT_EQ(got[i].text, want[i].text) << "client " << i << " (" << prompt_of(i) << ")";
    EXPECT_EQ(got[i].usage, want[i].usage) << "client " << i;
  }
  // The prompts are distinct, and so (mostly) are the outputs: the comparison is not vacuous.
  std::set<std::string> distinct;
  for (const Stream& s : want) distinct.insert(s.text);
  EXPECT_GT(distinct.size(), 8u);
  expect_idle_and_serving(load_server());
}

TEST(ServerLoad, TwoHundredStreamsAThirdDroppedMidStream) {
  // The dropped requests ask for far more tokens than they read, so each is still generating when
  // its client leaves and must be aborted (its blocks freed) by the server; the others are complete.
  constexpr int kRequests = 200, kThreads = 16, kTokens = 32, kDroppedTokens = 1000, kPrompts = 16;
  const std::vector<Stream> want = alone(kPrompts, kTokens);
  const int64_t gone_before = load_server().server->metrics().client_disconnects();

  // The plan, from a seeded RNG: which requests are dropped, and after how many data events.
  std::mt19937 rng(20261201);
  std::vector<int> drop_after(kRequests, 0);
  std::vector<int> order(kRequests);
  for (int i = 0; i < kRequests; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::uniform_int_distribution<int> point(1, kTokens - 2);
  for (int i = 0; i < kRequests / 3; ++i) drop_after[order[i]] = point(rng);

  std::vector<Stream> got(kRequests);
  std::atomic<int> next{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < kRequests;) {
        auto c = load_server().client();  // a fresh connection each time: a dropped one is closed
        const int max_tokens = drop_after[i] > 0 ? kDroppedTokens : kTokens;
        got[i] = stream_completion(*c, stream_body(prompt_of(i % kPrompts), max_tokens), drop_after[i]);
      }
    });
  for (auto& t : threads) t.join();

  int dropped = 0;
  for (int i = 0; i < kRequests; ++i) {
    const std::string what = "request " + std::to_string(i);
    const std::string& whole = want[i % kPrompts].text;
    if (drop_after[i] > 0) {
      ++dropped;
      EXPECT_EQ(got[i].status, 200) << what;
      EXPECT_FALSE(got[i].bad_event) << what;
      EXPECT_FALSE(got[i].done) << what;
      EXPECT_EQ(got[i].chunks.size(), static_cast<size_t>(drop_after[i])) << what;
      // What was read before leaving agrees with the greedy answer as far as both go.
      const size_t n = std::min(whole.size(), got[i].text.size());
      EXPECT_EQ(got[i].text.substr(0, n), whole.substr(0, n)) << what;
      EXPECT_FALSE(got[i].text.empty()) << what;
    } else {
      expect_complete(got[i], kTokens, what);
      EXPECT_EQ(got[i].text, whole) << what;
    }
  }
  EXPECT_EQ(dropped, kRequests / 3);
  expect_idle_and_serving(load_server());
  // Every dropped stream was still generating, so the server saw each one go.
  EXPECT_EQ(load_server().server->metrics().client_disconnects() - gone_before, dropped);
}

}  // namespace
}  // namespace moat::server
