// Streaming OpenAI-compatible client: POSTs one request to /v1/completions or
// /v1/chat/completions with "stream": true and records when each non-empty chunk arrived.
// One StreamingClient per worker thread holds one keep-alive connection; stop() may be called
// from another thread to abort the request in flight (Ctrl-C).
//
// Servers close kept-alive connections when they like: llama-server advertises
// "Keep-Alive: timeout=5, max=100" yet closes a moment after every streamed response, so a
// request written onto that connection in the moment before the close is never answered. When
// the transport fails on a reused connection before the response's status line and headers
// arrived, the request is resent once on a fresh connection (the server never answered it; it
// is the client's loss, not a server failure), and that client stops reusing connections, since
// its server closes them. A failure on a fresh connection, or after the response began, is the
// server's and is recorded as such.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "bench/clock.h"
#include "bench/metrics.h"
#include "bench/workload.h"

namespace httplib {
class Client;
}

namespace moat::bench {

struct EndpointConfig {
  std::string base_url;  // http(s)://host:port, optionally with a path prefix such as /v1
  std::string model;     // sent as "model"; empty: ask GET /v1/models first (see fetch_model_id)
  std::string api_key;   // sent as "Authorization: Bearer ..." when set
  bool chat = false;     // /v1/chat/completions instead of /v1/completions
  bool ignore_eos = true;  // vLLM, sglang and llama-server honour it; makes output lengths exact
  double timeout_s = 3600;  // per read; long prompts can take minutes to the first token
};

// "http://host:8000/v1/" -> scheme_host_port "http://host:8000", path "/v1/completions".
struct ParsedUrl {
  std::string scheme_host_port;
  std::string prefix;  // without a trailing "/v1"
};
Result<ParsedUrl> parse_base_url(const std::string& base_url);

std::string request_path(const EndpointConfig& endpoint);  // e.g. "/v1/chat/completions"
std::string request_body(const EndpointConfig& endpoint, const BenchRequest& request);

// The first model id from GET /v1/models, for servers that serve one model.
Result<std::string> fetch_model_id(const EndpointConfig& endpoint);

// Splits a byte stream into SSE "data:" payloads, whatever the TCP segmentation.
class SseSplitter {
 public:
  template <class F>
  void feed(std::string_view bytes, F&& on_data) {
    buffer_.append(bytes);
    size_t start = 0;
    for (size_t nl; (nl = buffer_.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string_view line(buffer_.data() + start, nl - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.substr(0, 5) != "data:") continue;  // comments, event:, id:, blank separators
      line.remove_prefix(5);
      if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
      saw_data_ = true;
      on_data(line);
    }
    buffer_.erase(0, start);
  }
  bool saw_data() const { return saw_data_; }
  const std::string& pending() const { return buffer_; }

 private:
  std::string buffer_;
  bool saw_data_ = false;
};

class StreamingClient {
 public:
  static Result<std::unique_ptr<StreamingClient>> create(const EndpointConfig& endpoint);
  ~StreamingClient();

  // Sends one request and blocks until its stream ends. Never throws; failures are recorded in
  // the returned record. When *cancel becomes true the request is abandoned and marked cancelled.
  RequestRecord send(const BenchRequest& request, const std::atomic<bool>* cancel);

  // Thread-safe: shuts the socket so a send() blocked on a silent server returns at once.
  void stop();

 private:
  StreamingClient(EndpointConfig endpoint, std::string path, std::unique_ptr<httplib::Client> cli);
  struct Attempt;
  Attempt send_once(const BenchRequest& request, const std::atomic<bool>* cancel);
  EndpointConfig endpoint_;
  std::string path_;
  std::unique_ptr<httplib::Client> cli_;
  // Sockets httplib has created: unchanged across an attempt means it went over a reused one.
  std::atomic<int64_t> connections_opened_{0};
};

}  // namespace moat::bench
