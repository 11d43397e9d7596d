// A small OpenAI-compatible streaming server for the bench tests: known delays, optional usage,
// empty chunks, and scripted failures. Runs on 127.0.0.1 on a free port for one test.
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace moat::bench::testing {

struct FakeOptions {
  int first_ms = 200;     // send -> first token
  int gap_ms = 50;        // between tokens
  bool usage = true;      // final usage chunk when stream_options.include_usage
  int prompt_tokens = 0;  // reported in usage; 0 = the prompt's word count
  bool empty_chunks = false;  // an empty chunk at once and one between tokens
  int http_500_every = 0;     // request k (1-based) fails with HTTP 500 when k % N == 0
  int midstream_error_every = 0;  // request k sends two tokens, then an error event
  int port = 0;               // 0: any free port
};

class FakeServer {
 public:
  explicit FakeServer(FakeOptions o) : o_(o) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(96); };
    server_.set_tcp_nodelay(true);
    server_.set_keep_alive_max_count(1000000);
    auto handler = [this](bool chat) {
      return [this, chat](const httplib::Request& req, httplib::Response& res) {
        handle(req, res, chat);
      };
    };
    server_.Post("/v1/completions", handler(false));
    server_.Post("/v1/chat/completions", handler(true));
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"fake-model","object":"model"}]})",
                      "application/json");
    });
    if (o_.port > 0) {
      port_ = server_.bind_to_port("127.0.0.1", o_.port) ? o_.port : -1;
    } else {
      port_ = server_.bind_to_any_port("127.0.0.1");
    }
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeServer() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return count_.load(); }

 private:
  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    int k = ++count_;
    auto body = nlohmann::json::parse(req.body, nullptr, false);
    if (o_.http_500_every > 0 && k % o_.http_500_every == 0) {
      res.status = 500;
      res.set_content(R"({"error":{"message":"fake overload","type":"server_error"}})",
                      "application/json");
      return;
    }
    int n = body.value("max_tokens", 16);
    bool include_usage = body.contains("stream_options") &&
                         body["stream_options"].value("include_usage", false) && o_.usage;
    int prompt_tokens = o_.prompt_tokens;
    bool fail_mid = o_.midstream_error_every > 0 && k % o_.midstream_error_every == 0;
    auto start = std::chrono::steady_clock::now();
    res.set_chunked_content_provider(
        "text/event-stream",
        [=, this](size_t, httplib::DataSink& sink) {
          auto event = [&](const nlohmann::json& j) {
            std::string s = "data: " + j.dump() + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto token = [&](const std::string& text) {
            nlohmann::json c = chat ? nlohmann::json{{"index", 0}, {"delta", {{"content", text}}}}
                                    : nlohmann::json{{"index", 0}, {"text", text}};
            return event({{"object", chat ? "chat.completion.chunk" : "text_completion"},
                          {"choices", {c}}});
          };
          if (chat) event({{"choices", {{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}}}}});
          if (o_.empty_chunks) token("");
          for (int i = 0; i < n; ++i) {
            std::this_thread::sleep_until(start + std::chrono::milliseconds(o_.first_ms + i * o_.gap_ms));
            if (fail_mid && i == 2) {
              event({{"error", {{"message", "fake mid-stream failure"}, {"code", 500}}}});
              sink.done();
              return true;
            }
            if (!token(" tok")) return false;
            if (o_.empty_chunks && i + 1 < n) token("");
          }
          if (include_usage)
            event({{"choices", nlohmann::json::array()},
                   {"usage", {{"prompt_tokens", prompt_tokens}, {"completion_tokens", n}}}});
          std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          sink.done();
          return true;
        });
  }

  FakeOptions o_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::atomic<int> count_{0};
};

}  // namespace moat::bench::testing
