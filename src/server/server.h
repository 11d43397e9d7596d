// The OpenAI-compatible HTTP server (`moat serve`) on cpp-httplib, in front of an AsyncEngine.
//
// Routes: POST /v1/completions, POST /v1/chat/completions (streaming as SSE or not),
// GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize.
//
// Threads: httplib runs each connection on a worker of its own pool (ServerOptions::http_threads,
// sized for every concurrent stream plus the waiting queue); a generation handler parses and
// validates on that worker, submits one engine request per choice, and then writes the response
// from a chunked content provider that waits on the requests' RequestStreams. Streaming and
// non-streaming responses both go out through that provider, because only there does httplib
// 0.11 let the server see the client leave (DataSink::is_writable() false: the socket peeked
// closed, or a write failed): the provider checks at every output and every 50 ms while it
// waits, and aborts the engine requests at once, freeing their KV blocks. The cost for
// non-streaming responses is chunked transfer encoding instead of a Content-Length, and a status
// (200) that is committed when the engine has accepted the request.
//
// Lifecycle: bind() then serve() (it blocks) on one thread; /health is 503 until attach() hands
// over the loaded model, so a supervisor can watch the port from the start. begin_shutdown()
// turns new requests away with 503; abort_all() ends in-flight ones; stop() closes the listener.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "engine/async_engine.h"
#include "server/metrics.h"
#include "server/protocol.h"

namespace httplib {
class Server;
}

namespace moat::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0: any free port (port() says which)
  std::string served_model_name;        // /v1/models, metrics labels, and the accepted "model"
  std::vector<std::string> model_aliases;  // also accepted in "model" (e.g. the model dir's name)
  std::string api_key;                  // non-empty: every route but /health and /metrics needs it
  size_t max_body_bytes = 8 << 20;      // larger bodies: 413
  int http_threads = 128;               // connections served at once (streams, waiting, the rest)
  int write_timeout_s = 30;             // a client that takes no bytes for this long is gone
  bool access_log = true;               // one line per request on stderr
  ParseLimits limits;
};

// The loaded model as the server uses it. Everything it points to must outlive the server.
struct ServedModel {
  AsyncEngine* engine = nullptr;
  ModelInfo info;
  std::string root;  // the model directory, for /v1/models
};

class OpenAIServer {
 public:
  explicit OpenAIServer(ServerOptions options);
  ~OpenAIServer();
  OpenAIServer(const OpenAIServer&) = delete;
  OpenAIServer& operator=(const OpenAIServer&) = delete;

  // Binds host:port. Errors name the address.
  Status bind();
  int port() const { return port_; }
  // Accepts and serves until stop(); call after bind(), on a thread of its own.
  void serve();
  // The model is ready: generation routes open and /health answers 200.
  void attach(ServedModel model);
  bool ready() const;
  // New requests get 503 and /health 503; requests in flight go on.
  void begin_shutdown();
  // Aborts the engine requests of every response in flight (finish_reason "abort").
  void abort_all();
  // True once no generation response is in flight, waiting up to `timeout`.
  bool wait_idle(std::chrono::milliseconds timeout);
  int64_t in_flight() const;
  // Closes the listener and the connections; serve() returns.
  void stop();

  const ServerMetrics& metrics() const { return metrics_; }

  struct Generation;  // one generation response in flight (server.cpp)

 private:
  void routes();
  void on_generation_end(Generation* g);
  void record_metrics(Generation* g);  // once per response

  ServerOptions options_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::atomic<bool> ready_{false}, shutting_down_{false};
  ServedModel model_;  // written once by attach(), before ready_
  ServerMetrics metrics_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::unordered_set<Generation*> in_flight_;
  int64_t started_ = 0;  // unix time, for /v1/models "created"
};

}  // namespace moat::server
