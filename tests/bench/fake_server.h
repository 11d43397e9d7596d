// A small OpenAI-compatible streaming server for the bench tests: known delays, optional usage,
// empty chunks, scripted failures, and servers that close kept-alive connections. Runs on
// 127.0.0.1 on a free port for one test. It stamps every request on the client's clock
// (bench/clock.h) when its handler received it and just before each token went to the socket,
// so that tests compare what the client measured with what the server did instead of with
// nominal delays that a loaded machine stretches.
#pragma once

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/clock.h"

namespace moat::bench::testing {

struct FakeOptions {
  int first_ms = 200;     // handler receives the request -> first token
  int gap_ms = 50;        // between tokens
  bool usage = true;      // final usage chunk when stream_options.include_usage
  int prompt_tokens = 0;  // reported in usage (unless tokens_per_word is set)
  bool empty_chunks = false;  // an empty chunk at once and one between tokens
  int http_500_every = 0;     // request k (1-based) fails with HTTP 500 when k % N == 0
  int midstream_error_every = 0;  // request k sends two tokens, then an error event
  int drop_midstream_every = 0;   // request k sends two tokens, then the connection is cut
  int port = 0;               // 0: any free port
  // >= 0: behave like llama-server: advertise "Keep-Alive: timeout=5, max=100", then close the
  // connection after each response without reading the next request. The close comes when the
  // next request arrives on the connection, or close_after_ms after the response when none does,
  // so a client that reuses the connection loses that request every time, not by chance.
  int close_after_ms = -1;
  // > 0: usage.prompt_tokens is round(words x tokens_per_word) + prompt_overhead_tokens, the way
  // a real tokenizer makes several tokens of a word and the server adds BOS or a chat template.
  double tokens_per_word = 0;
  int prompt_overhead_tokens = 0;
  bool tokenize_endpoint = false;  // POST /tokenize answers {"tokens": [...]} (llama-server, vLLM)
  // Requests k >= hang_from_request send two tokens, then only SSE comments until the client
  // goes away (or 30 s): a stream that ends only if the client aborts it.
  int hang_from_request = 0;
  // > 0: no request gets its first token before this many requests have been received (or 30 s
  // passed), so a client that keeps that many in flight is seen to, whatever the machine's speed.
  int hold_first_token_until = 0;
};

// What the server did for one request, stamped with bench::monotonic_s().
struct Served {
  int index = 0;             // 1-based, in the order the handlers started
  int remote_port = 0;       // identifies the client's connection
  std::string prompt;        // "prompt", or the last message's content
  double received_s = 0;     // the handler started: the whole request had been read
  std::vector<double> token_s;  // just before each non-empty token was written to the socket
  double finished_s = 0;     // after the last byte of the stream was written; 0 if cut short
};

class FakeServer {
 public:
  explicit FakeServer(FakeOptions o) : o_(o) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(96); };
    server_.set_tcp_nodelay(true);
    // close_after_ms: one request per connection, so httplib closes each after its response
    // (and adds "Connection: close", which the handler's earlier "keep-alive" shadows for clients
    // that read the first Connection header, as httplib's does).
    server_.set_keep_alive_max_count(o_.close_after_ms >= 0 ? 1 : 1000000);
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
    if (o_.tokenize_endpoint) {
      server_.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
        auto body = nlohmann::json::parse(req.body, nullptr, false);
        std::string text = body.is_object() ? body.value("content", body.value("prompt", "")) : "";
        ++tokenize_calls_;
        res.set_content(nlohmann::json{{"tokens", std::vector<int>(text_tokens(text), 7)}}.dump(),
                        "application/json");
      });
    }
    if (o_.port > 0) {
      port_ = server_.bind_to_port("127.0.0.1", o_.port) ? o_.port : -1;
    } else {
      port_ = server_.bind_to_any_port("127.0.0.1");
    }
    if (port_ <= 0) return;  // url() says so with port -1
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    // is_running() turns true before httplib has started the 96 threads of its pool and called
    // accept(); on a 2-core VM that takes 15-35 ms, which the first requests would spend in the
    // listen backlog and which tests measured as TTFT. One answered request proves it accepts.
    httplib::Client probe("127.0.0.1", port_);
    while (!probe.Get("/v1/models")) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeServer() {
    stopping_ = true;
    if (!thread_.joinable()) return;
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int requests() const { return count_.load(); }
  int tokenize_calls() const { return tokenize_calls_.load(); }
  std::vector<Served> served() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Served> out;
    for (const Served& s : served_)
      if (s.index > 0) out.push_back(s);  // slots of handlers that have not reached the lock yet
    return out;
  }
  // The record of the request with this prompt (prompts of a workload are distinct); null if none.
  const Served* find(const std::vector<Served>& all, const std::string& prompt) const {
    for (const Served& s : all)
      if (s.prompt == prompt) return &s;
    return nullptr;
  }

  // Tokens the fake tokenizer makes of a text: one per word, or tokens_per_word per word.
  int text_tokens(const std::string& text) const {
    std::istringstream in(text);
    int words = 0;
    for (std::string w; in >> w;) ++words;
    return o_.tokens_per_word > 0 ? static_cast<int>(std::lround(words * o_.tokens_per_word)) : words;
  }

 private:
  // httplib hands handlers no socket; the accepted one is the fd whose peer is the request's
  // remote port and whose local port is ours (the client's end, in the same process, has them
  // the other way round).
  int connection_fd(int remote_port) const {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
      int fd = std::atoi(entry.path().filename().c_str());
      sockaddr_in peer{}, local{};
      socklen_t n = sizeof(peer), m = sizeof(local);
      if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &n) != 0 || peer.sin_family != AF_INET)
        continue;
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &m) != 0) continue;
      if (ntohs(peer.sin_port) == remote_port && ntohs(local.sin_port) == port_) return fd;
    }
    return -1;
  }

  // Called from the response's destructor, after its last byte was written and before httplib
  // closes the connection (keep-alive max count 1): holds the close until the client has sent its
  // next request on the connection, so the close discards that request unanswered.
  void hold_close(int remote_port) const {
    int fd = connection_fd(remote_port);
    if (fd < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.close_after_ms));
      return;
    }
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, o_.close_after_ms);
  }

  // Request k's record is served_[k - 1], so a token's stamp costs no search.
  void record(int index, const std::function<void(Served&)>& f) {
    std::lock_guard<std::mutex> lock(mu_);
    f(served_[index - 1]);
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    const auto start = std::chrono::steady_clock::now();
    int k = ++count_;
    auto body = nlohmann::json::parse(req.body, nullptr, false);
    std::string prompt;
    if (body.is_object() && body.contains("prompt") && body["prompt"].is_string())
      prompt = body["prompt"].get<std::string>();
    else if (body.is_object() && body.contains("messages") && body["messages"].is_array() &&
             !body["messages"].empty())
      prompt = body["messages"].back().value("content", "");
    {
      Served s;
      s.index = k;
      s.remote_port = req.remote_port;
      s.prompt = prompt;
      s.received_s = to_monotonic_s(start);
      std::lock_guard<std::mutex> lock(mu_);
      if (served_.size() < static_cast<size_t>(k)) served_.resize(k);
      served_[k - 1] = std::move(s);
    }
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
    if (o_.tokens_per_word > 0) prompt_tokens = text_tokens(prompt) + o_.prompt_overhead_tokens;
    bool fail_mid = o_.midstream_error_every > 0 && k % o_.midstream_error_every == 0;
    bool drop_mid = o_.drop_midstream_every > 0 && k % o_.drop_midstream_every == 0;
    bool hang = o_.hang_from_request > 0 && k >= o_.hang_from_request;
    if (o_.close_after_ms >= 0) {
      // llama-server's headers: keep-alive is promised, then the connection is closed anyway.
      res.set_header("Connection", "keep-alive");
      res.set_header("Keep-Alive", "timeout=5, max=100");
    }
    int remote_port = req.remote_port;
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
            if (!text.empty()) {
              double now = monotonic_s();
              record(k, [now](Served& s) { s.token_s.push_back(now); });
            }
            return event({{"object", chat ? "chat.completion.chunk" : "text_completion"},
                          {"choices", {c}}});
          };
          if (chat) event({{"choices", {{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}}}}});
          if (o_.empty_chunks) token("");
          if (o_.hold_first_token_until > 0) {
            auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
            while (count_.load() < o_.hold_first_token_until && !stopping_ &&
                   std::chrono::steady_clock::now() < until)
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          for (int i = 0; i < n; ++i) {
            std::this_thread::sleep_until(start + std::chrono::milliseconds(o_.first_ms + i * o_.gap_ms));
            if (fail_mid && i == 2) {
              event({{"error", {{"message", "fake mid-stream failure"}, {"code", 500}}}});
              sink.done();
              return true;
            }
            if (drop_mid && i == 2) return false;  // httplib cuts the connection mid-body
            if (hang && i == 2) {
              // Comments keep the connection busy; a write fails once the client has gone.
              const std::string ping = ": waiting\n\n";
              auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
              while (!stopping_ && std::chrono::steady_clock::now() < until &&
                     sink.write(ping.data(), ping.size()))
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
              if (stopping_ || std::chrono::steady_clock::now() < until) return false;
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
          double now = monotonic_s();
          record(k, [now](Served& s) { s.finished_s = now; });
          return true;
        },
        [this, remote_port](bool) {
          if (o_.close_after_ms >= 0) hold_close(remote_port);
        });
  }

  FakeOptions o_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::atomic<int> count_{0}, tokenize_calls_{0};
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::vector<Served> served_;
};

}  // namespace moat::bench::testing
