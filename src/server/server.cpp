#include "server/server.h"

#include <sys/socket.h>

#include <httplib.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <random>

#include "base/log.h"

namespace moat::server {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// How long a connection thread sleeps when its requests produce nothing before it looks at the
// socket. Each wake-up on a machine with as many cores as engine threads preempts a pool worker
// mid-kernel and stalls that parallel region: at 50 ms, 64 idle streams cost 5-7% of decode
// throughput. Outputs wake the thread at once whatever this is.
constexpr std::chrono::milliseconds kIdleCheck(500);

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Generated text is valid UTF-8 (the detokenizer guarantees it), but decoded token ids and
// client strings echoed in messages need not be: replace instead of throwing.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string random_hex(size_t n) {
  static std::mutex mu;
  static std::mt19937_64 rng(static_cast<uint64_t>(std::random_device{}()) << 32 ^ std::random_device{}());
  std::lock_guard lock(mu);
  std::string s;
  while (s.size() < n) s += fmt::format("{:016x}", rng());
  return s.substr(0, n);
}

// What the access log line says about a request. httplib calls the logger on the worker thread
// that handled the request, right after the response (content provider included) was written,
// so handlers and providers fill this thread's copy and the logger reads and resets it.
struct AccessInfo {
  Clock::time_point start{};
  bool started = false;
  std::string id;
  int64_t prompt_tokens = -1, completion_tokens = -1;
};
thread_local AccessInfo t_access;

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

// A logprob that JSON can carry: -inf (a banned token) becomes vLLM's -9999.
double finite_logprob(float lp) { return std::isfinite(lp) ? lp : -9999.0; }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

}  // namespace

// One engine request (a choice) of a response.
struct Choice {
  std::shared_ptr<RequestStream> stream;
  int index = 0, prompt = 0;
  bool finished = false, sent_role = false, sent_echo = false;
  FinishReason reason = FinishReason::none;
  std::string stop_string;
  int32_t last_token = -1;
  std::string error;  // an internal refusal after submit (the engine's message)
  std::string text;   // non-streaming: the whole text
  json logprobs;      // non-streaming: the accumulated logprobs object
  int64_t text_offset = 0;
  int64_t prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  double first_token_s = -1, last_token_s = -1;
  std::vector<double> itl;
};

struct OpenAIServer::Generation {
  OpenAIServer* server = nullptr;
  std::string id;
  Api api = Api::completions;
  std::string model;
  int64_t created = 0;
  Clock::time_point arrival;
  OpenAIRequest request;
  PreparedRequest prepared;
  std::vector<Choice> choices;
  std::shared_ptr<StreamSignal> signal = std::make_shared<StreamSignal>();  // rung by every choice's stream
  bool client_gone = false;
  bool recorded = false;

  bool chat() const { return api == Api::chat; }
  bool all_finished() const {
    return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return c.finished; });
  }
  void abort_unfinished() {
    for (Choice& c : choices)
      if (!c.finished) server->model_.engine->abort(c.stream->id());
  }

  // Waits up to `wait` for outputs and hands each to `on_output(choice, out)`.
  template <class F>
  void pump(std::chrono::milliseconds wait, F&& on_output) {
    auto drain = [&] {
      bool got = false;
      for (Choice& c : choices) {
        while (!c.finished) {
          auto out = c.stream->next(std::chrono::milliseconds(0));
          if (!out) break;
          got = true;
          take(c, *out);
          on_output(c, *out);
        }
      }
      return got;
    };
    // Read before the streams are looked at: an output pushed after the look rings past it.
    const uint64_t seen = signal->rings();
    if (drain()) return;
    signal->wait(seen, wait);
    drain();
  }

  // Bookkeeping every output needs, whatever the response format.
  void take(Choice& c, const RequestOutput& out) {
    const double now = seconds_since(arrival);
    if (!out.new_tokens.empty()) {
      if (c.first_token_s < 0) c.first_token_s = now;
      else c.itl.push_back(now - c.last_token_s);
      c.last_token_s = now;
      c.last_token = out.new_tokens.back();
    }
    c.prompt_tokens = out.prompt_tokens;
    c.output_tokens = out.output_tokens;
    c.cached_tokens = out.cached_tokens;
    if (out.finished) {
      c.finished = true;
      c.reason = out.finish_reason;
      c.stop_string = out.stop_string;
      // An abort nobody asked for, with a message: the engine thread refused the request.
      if (out.finish_reason == FinishReason::abort && !out.text.empty() && out.output_tokens == 0 && !client_gone)
        c.error = out.text;
    }
  }

  // vLLM's stop_reason: the stop string, or the stop token id that is not EOS; else null.
  json stop_reason(const Choice& c) const {
    if (c.reason != FinishReason::stop) return nullptr;
    if (!c.stop_string.empty()) return c.stop_string;
    const auto& ids = request.stop_token_ids;
    if (std::find(ids.begin(), ids.end(), c.last_token) != ids.end()) return c.last_token;
    return nullptr;
  }

  json usage() const {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (int64_t p : prepared.prompt_tokens) prompt += p;
    for (const Choice& c : choices) completion += c.output_tokens;
    // cached tokens per prompt: the best any of its choices saw
    std::vector<int64_t> best(prepared.prompt_tokens.size(), 0);
    for (const Choice& c : choices) best[c.prompt] = std::max(best[c.prompt], c.cached_tokens);
    for (int64_t b : best) cached += b;
    json u = json::object();
    u["prompt_tokens"] = prompt;
    u["completion_tokens"] = completion;
    u["total_tokens"] = prompt + completion;
    u["prompt_tokens_details"] = {{"cached_tokens", cached}};
    return u;
  }

  // Logprobs of `out`'s tokens in the response's format; appended to `acc` (which starts null).
  void add_logprobs(json& acc, Choice& c, const RequestOutput& out) const {
    const Tokenizer& tok = *server->model_.info.tokenizer;
    if (chat()) {
      if (acc.is_null()) acc = {{"content", json::array()}};
      for (const SampledToken& s : out.logprobs) {
        const std::string t = token_text(tok, s.token);
        json e = {{"token", t}, {"logprob", finite_logprob(s.logprob)}, {"bytes", bytes_of(tok.token_bytes(s.token))}};
        json top = json::array();
        for (const auto& [id, lp] : s.top_logprobs)
          top.push_back({{"token", token_text(tok, id)}, {"logprob", finite_logprob(lp)}, {"bytes", bytes_of(tok.token_bytes(id))}});
        e["top_logprobs"] = top;
        acc["content"].push_back(e);
      }
      return;
    }
    if (acc.is_null())
      acc = {{"text_offset", json::array()}, {"token_logprobs", json::array()}, {"tokens", json::array()}, {"top_logprobs", json::array()}};
    for (const SampledToken& s : out.logprobs) {
      const std::string t = token_text(tok, s.token);
      acc["text_offset"].push_back(c.text_offset);
      acc["token_logprobs"].push_back(finite_logprob(s.logprob));
      acc["tokens"].push_back(t);
      // vLLM's top dict holds the sampled token too.
      json top = json::object();
      for (const auto& [id, lp] : s.top_logprobs) top[token_text(tok, id)] = finite_logprob(lp);
      top[t] = finite_logprob(s.logprob);
      acc["top_logprobs"].push_back(top);
      c.text_offset += static_cast<int64_t>(tok.token_bytes(s.token).size());
    }
  }

  json chunk_head() const {
    json j = json::object();
    j["id"] = id;
    j["object"] = chat() ? "chat.completion.chunk" : "text_completion";
    j["created"] = created;
    j["model"] = model;
    return j;
  }

  // The SSE chunks one output makes ("" when it makes none).
  std::string stream_chunks(Choice& c, const RequestOutput& out) {
    std::string sse;
    auto emit = [&](json choice) {
      json j = chunk_head();
      j["choices"] = json::array({std::move(choice)});
      if (request.include_usage) j["usage"] = nullptr;
      sse += "data: " + dump(j) + "\n\n";
    };
    if (!c.error.empty()) {
      ApiError e{.status = 500, .message = c.error, .type = "server_error"};
      sse += "data: " + dump(error_json(e)) + "\n\n";
      return sse;
    }
    json lp = nullptr;
    if (request.logprobs && !out.logprobs.empty()) add_logprobs(lp, c, out);
    std::string text = out_text(out);
    if (!chat() && request.echo && !c.sent_echo) {
      text = prepared.echo[c.prompt] + text;
      c.sent_echo = true;
    }
    if (text.empty() && lp.is_null() && !out.finished) return sse;
    json choice = json::object();
    choice["index"] = c.index;
    if (chat()) {
      choice["delta"] = text.empty() && out.finished ? json::object() : json{{"content", text}};
    } else {
      choice["text"] = text;
    }
    choice["logprobs"] = lp;
    choice["finish_reason"] = out.finished ? finish_reason_json(c.reason) : json(nullptr);
    if (out.finished) choice["stop_reason"] = stop_reason(c);
    emit(std::move(choice));
    return sse;
  }

  // The chunks a stream opens with: the assistant role for chat (vLLM, OpenAI), the prompt for
  // completions with echo.
  std::string stream_open() {
    std::string sse;
    for (Choice& c : choices) {
      json choice = json::object();
      choice["index"] = c.index;
      if (chat()) {
        choice["delta"] = {{"role", "assistant"}, {"content", ""}};
      } else if (request.echo) {
        choice["text"] = prepared.echo[c.prompt];
        c.sent_echo = true;
      } else {
        continue;
      }
      choice["logprobs"] = nullptr;
      choice["finish_reason"] = nullptr;
      json j = chunk_head();
      j["choices"] = json::array({std::move(choice)});
      if (request.include_usage) j["usage"] = nullptr;
      sse += "data: " + dump(j) + "\n\n";
    }
    return sse;
  }

  std::string stream_close() const {
    std::string sse;
    if (request.include_usage) {
      json j = chunk_head();
      j["choices"] = json::array();
      j["usage"] = usage();
      sse += "data: " + dump(j) + "\n\n";
    }
    return sse + "data: [DONE]\n\n";
  }

  // The output's text, with the stop string that ended it when the client asked for that.
  std::string out_text(const RequestOutput& out) const {
    if (out.finished && request.include_stop_str_in_output && !out.stop_string.empty()) return out.text + out.stop_string;
    return out.text;
  }

  void accumulate(Choice& c, const RequestOutput& out) {
    c.text += out_text(out);
    if (request.logprobs && !out.logprobs.empty()) add_logprobs(c.logprobs, c, out);
  }

  // The whole non-streaming response, or an error body when the engine refused a choice.
  std::string final_body() const {
    for (const Choice& c : choices)
      if (!c.error.empty()) return dump(error_json(ApiError{.status = 500, .message = c.error, .type = "server_error"}));
    json j = json::object();
    j["id"] = id;
    j["object"] = chat() ? "chat.completion" : "text_completion";
    j["created"] = created;
    j["model"] = model;
    j["choices"] = json::array();
    for (const Choice& c : choices) {
      json choice = json::object();
      choice["index"] = c.index;
      if (chat()) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        choice["logprobs"] = c.logprobs;
      } else {
        choice["text"] = (request.echo ? prepared.echo[c.prompt] : std::string()) + c.text;
        choice["logprobs"] = c.logprobs;
      }
      choice["finish_reason"] = finish_reason_json(c.reason);
      choice["stop_reason"] = stop_reason(c);
      j["choices"].push_back(std::move(choice));
    }
    j["usage"] = usage();
    return dump(j);
  }

  void fill_access_log() const {
    int64_t prompt = 0, completion = 0;
    for (int64_t p : prepared.prompt_tokens) prompt += p;
    for (const Choice& c : choices) completion += c.output_tokens;
    t_access.prompt_tokens = prompt;
    t_access.completion_tokens = completion;
  }

  // Streams SSE until every choice finished or the client left. Returns false when it left.
  bool run_stream(httplib::DataSink& sink) {
    auto write = [&](const std::string& s) {
      if (s.empty()) return true;
      if (!sink.is_writable() || !sink.write(s.data(), s.size())) {
        client_gone = true;
        return false;
      }
      return true;
    };
    if (!write(stream_open())) return false;
    while (!all_finished()) {
      std::string batch;
      // A client that leaves while tokens flow is seen by the next write; kIdleCheck only bounds
      // how long one that leaves while its request waits goes unnoticed.
      pump(kIdleCheck, [&](Choice& c, const RequestOutput& out) { batch += stream_chunks(c, out); });
      if (batch.empty() ? !sink.is_writable() : !write(batch)) {
        client_gone = true;
        return false;
      }
    }
    // Recorded before the last bytes go out, so a client that reads /metrics after its
    // response sees the response counted.
    server->record_metrics(this);
    if (!write(stream_close())) return false;
    sink.done();
    return true;
  }

  bool run_blocking(httplib::DataSink& sink) {
    auto checked = Clock::now();
    while (!all_finished()) {
      pump(kIdleCheck, [&](Choice& c, const RequestOutput& out) { accumulate(c, out); });
      // Nothing goes to the client before the end, so a look at the socket every kIdleCheck is
      // the only sign that it left.
      if (Clock::now() - checked >= kIdleCheck) {
        checked = Clock::now();
        if (!sink.is_writable()) {
          client_gone = true;
          return false;
        }
      }
    }
    const std::string body = final_body();
    server->record_metrics(this);
    if (!sink.write(body.data(), body.size())) {
      client_gone = true;
      return false;
    }
    sink.done();
    return true;
  }
};

OpenAIServer::OpenAIServer(ServerOptions options)
    : options_(std::move(options)),
      http_(std::make_unique<httplib::Server>()),
      metrics_(options_.served_model_name),
      started_(static_cast<int64_t>(std::time(nullptr))) {
  const int threads = std::max(4, options_.http_threads);
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http_->set_tcp_nodelay(true);  // SSE chunks are small and must not wait for Nagle
  http_->set_payload_max_length(options_.max_body_bytes);
  http_->set_write_timeout(options_.write_timeout_s, 0);
  routes();
}

OpenAIServer::~OpenAIServer() { stop(); }

Status OpenAIServer::bind() {
  // Debian's libcpp-httplib is compiled with a listen backlog of 5: a burst of clients
  // connecting at once (64 streams opening together) overflowed the accept queue and some got no
  // response at all. Keep the listening socket (also setting the SO_REUSEADDR httplib's default
  // options set) and listen on it again with a real backlog once it is bound.
  int listen_fd = -1;
  http_->set_socket_options([&listen_fd](socket_t fd) {
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listen_fd = fd;
  });
  auto widen_backlog = [&listen_fd] {
    if (listen_fd >= 0) ::listen(listen_fd, 1024);
  };
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
    if (port_ < 0) return make_error("cannot bind {} on any port", options_.host);
  } else {
    if (!http_->bind_to_port(options_.host, options_.port))
      return make_error("cannot bind {}:{} (in use, or not an address of this machine?)", options_.host, options_.port);
    port_ = options_.port;
  }
  widen_backlog();
  return ok_status();
}

void OpenAIServer::serve() { http_->listen_after_bind(); }

void OpenAIServer::attach(ServedModel model) {
  model_ = std::move(model);
  ready_.store(true, std::memory_order_release);
}

bool OpenAIServer::ready() const { return ready_.load(std::memory_order_acquire) && !shutting_down_.load(); }

void OpenAIServer::begin_shutdown() { shutting_down_ = true; }

void OpenAIServer::abort_all() {
  std::lock_guard lock(mu_);
  for (Generation* g : in_flight_)
    for (const Choice& c : g->choices) model_.engine->abort(c.stream->id());
}

bool OpenAIServer::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return idle_.wait_for(lock, timeout, [&] { return in_flight_.empty(); });
}

int64_t OpenAIServer::in_flight() const {
  std::lock_guard lock(mu_);
  return static_cast<int64_t>(in_flight_.size());
}

void OpenAIServer::stop() {
  if (http_) http_->stop();
}

void OpenAIServer::on_generation_end(Generation* g) {
  // Whatever ended the response (its end, a write failure, the server stopping), no engine
  // request of it may run on.
  if (!g->all_finished()) {
    g->client_gone = true;
    g->abort_unfinished();
  }
  record_metrics(g);
  {
    std::lock_guard lock(mu_);
    in_flight_.erase(g);
  }
  idle_.notify_all();
}

void OpenAIServer::record_metrics(Generation* g) {
  if (!g->recorded) {
    g->recorded = true;
    for (const Choice& c : g->choices) {
      FinishedRequest f;
      f.reason = c.finished ? c.reason : FinishReason::abort;
      f.client_gone = g->client_gone && (!c.finished || c.reason == FinishReason::abort);
      f.ttft_s = c.first_token_s;
      f.itl_s = c.itl;
      f.e2e_s = seconds_since(g->arrival);
      f.prompt_tokens = g->prepared.prompt_tokens[c.prompt];
      f.generation_tokens = c.output_tokens;
      f.cached_tokens = c.cached_tokens;
      metrics_.record(f);
    }
  }
}

void OpenAIServer::routes() {
  httplib::Server& s = *http_;

  s.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
    t_access = AccessInfo{};
    t_access.start = Clock::now();
    t_access.started = true;
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // httplib's own refusals (no route, body over the limit, a bad request line) get OpenAI's
  // error shape; handlers' errors already have a body.
  s.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e{.status = res.status, .message = fmt::format("HTTP {}", res.status)};
    if (res.status == 404) {
      e.message = fmt::format("no route {} {}", req.method, req.path);
      e.code = "not_found";
    } else if (res.status == 413) {
      e.message = "the request body is larger than the server accepts (--max-body-bytes)";
      e.code = "request_too_large";
    } else if (res.status == 400) {
      e.message = "malformed HTTP request";
    }
    send_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));

  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError{.status = 500, .message = "internal error: " + what, .type = "server_error"});
  });

  s.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics_.record_http(res.status);
    if (options_.access_log) {
      const std::string duration =
          t_access.started ? fmt::format("{:.1f}ms", seconds_since(t_access.start) * 1e3) : std::string("-");
      const auto count = [](int64_t n) { return n < 0 ? std::string("-") : std::to_string(n); };
      MOAT_LOG(info, "{} {} {} {} prompt={} completion={} {} {}", req.remote_addr, req.method, req.path, res.status,
               count(t_access.prompt_tokens), count(t_access.completion_tokens), duration,
               t_access.id.empty() ? "-" : t_access.id);
    }
    t_access = AccessInfo{};
  });

  // Refusals every model route shares; true when the request may go on.
  auto admit = [this](const httplib::Request& req, httplib::Response& res, bool needs_model) {
    if (!options_.api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      const std::string want = "Bearer " + options_.api_key;
      // Constant time in the key's length, so response times do not reveal a matching prefix.
      bool same = auth.size() == want.size();
      unsigned char diff = 0;
      for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned char>(want[i] ^ (i < auth.size() ? auth[i] : 0));
      if (!same || diff != 0) {
        send_error(res, ApiError{.status = 401,
                                 .message = auth.empty() ? "missing API key: send \"Authorization: Bearer <key>\""
                                                         : "invalid API key",
                                 .code = "invalid_api_key"});
        return false;
      }
    }
    if (needs_model && !ready_.load(std::memory_order_acquire)) {
      send_error(res, ApiError{.status = 503, .message = "the model is still loading", .type = "service_unavailable_error",
                               .code = "loading"});
      return false;
    }
    if (shutting_down_.load()) {
      send_error(res, ApiError{.status = 503, .message = "the server is shutting down", .type = "service_unavailable_error",
                               .code = "shutting_down"});
      return false;
    }
    return true;
  };

  // The body, read here rather than by httplib: httplib 0.11 enforces its payload limit on
  // Content-Length bodies only and would buffer a chunked upload of any size. Past the limit the
  // rest is read and dropped, so the connection stays in step for its next request.
  auto read_body = [this](const httplib::ContentReader& reader, httplib::Response& res, std::string& body) {
    bool too_large = false;
    const bool read = reader([&](const char* data, size_t n) {
      if (too_large || body.size() + n > options_.max_body_bytes) too_large = true;
      else body.append(data, n);
      return true;
    });
    if (too_large || res.status == 413) {
      send_error(res, ApiError{.status = 413,
                               .message = fmt::format("the request body is larger than the {} bytes the server accepts "
                                                      "(--max-body-bytes)", options_.max_body_bytes),
                               .code = "request_too_large"});
      return false;
    }
    if (!read) {
      send_error(res, ApiError{.status = 400, .message = "the request body could not be read"});
      return false;
    }
    return true;
  };

  auto known_model = [this](const std::string& name) {
    if (name.empty() || name == options_.served_model_name) return true;
    return std::find(options_.model_aliases.begin(), options_.model_aliases.end(), name) != options_.model_aliases.end();
  };

  // httplib 0.11 sends every POST (with a body or not) to the content-reader handlers.
  auto post = [this, read_body](const std::string& path, auto handle) {
    http_->Post(path, [read_body, handle](const httplib::Request& req, httplib::Response& res,
                                          const httplib::ContentReader& reader) {
      std::string body;
      if (read_body(reader, res, body)) handle(req, res, body);
    });
  };

  auto generate = [this, admit, known_model](Api api) {
    return [this, admit, known_model, api](const httplib::Request& req, httplib::Response& res, const std::string& body) {
      if (!admit(req, res, true)) return;
      auto parsed = parse_request(body, api, options_.limits);
      if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
      OpenAIRequest& request = std::get<OpenAIRequest>(parsed);
      if (!known_model(request.model))
        return send_error(res, ApiError{.status = 404,
                                        .message = fmt::format("the model `{}` does not exist; this server serves `{}`",
                                                               request.model, options_.served_model_name),
                                        .param = "model",
                                        .code = "model_not_found"});
      auto prepared = prepare(request, model_.info);
      if (auto* e = std::get_if<ApiError>(&prepared)) return send_error(res, *e);

      auto g = std::make_shared<Generation>();
      g->server = this;
      g->api = api;
      g->id = (api == Api::chat ? "chatcmpl-" : "cmpl-") + random_hex(32);
      g->model = options_.served_model_name;
      g->created = static_cast<int64_t>(std::time(nullptr));
      g->arrival = t_access.started ? t_access.start : Clock::now();
      g->request = std::move(request);
      g->prepared = std::move(std::get<PreparedRequest>(prepared));
      t_access.id = g->id;
      const int n = g->request.n;
      for (size_t i = 0; i < g->prepared.requests.size(); ++i) {
        auto submitted = model_.engine->submit(std::move(g->prepared.requests[i]), g->signal);
        if (auto* refusal = std::get_if<AsyncEngine::Refusal>(&submitted)) {
          // All choices or none: the ones already queued are taken back.
          for (const Choice& c : g->choices) model_.engine->abort(c.stream->id());
          return send_error(res, refusal_error(*refusal, api == Api::chat));
        }
        Choice c;
        c.stream = std::get<std::shared_ptr<RequestStream>>(submitted);
        c.index = static_cast<int>(i);
        c.prompt = static_cast<int>(i) / n;
        g->choices.push_back(std::move(c));
      }
      g->prepared.requests.clear();  // moved into the engine
      {
        std::lock_guard lock(mu_);
        in_flight_.insert(g.get());
      }
      res.set_header("X-Request-Id", g->id);
      const bool stream = g->request.stream;
      if (stream) res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          stream ? "text/event-stream" : "application/json",
          [g, stream](size_t, httplib::DataSink& sink) {
            const bool ok = stream ? g->run_stream(sink) : g->run_blocking(sink);
            g->fill_access_log();
            if (!ok) g->server->on_generation_end(g.get());
            return ok;
          },
          [g](bool) { g->server->on_generation_end(g.get()); });
    };
  };
  post("/v1/completions", generate(Api::completions));
  post("/v1/chat/completions", generate(Api::chat));

  s.Get("/v1/models", [this, admit](const httplib::Request& req, httplib::Response& res) {
    if (!admit(req, res, false)) return;
    json model = json::object();
    model["id"] = options_.served_model_name;
    model["object"] = "model";
    model["created"] = started_;
    model["owned_by"] = "moat";
    model["root"] = model_.root.empty() ? options_.served_model_name : model_.root;
    model["parent"] = nullptr;
    if (ready_.load(std::memory_order_acquire)) model["max_model_len"] = model_.info.max_model_len;
    json body = {{"object", "list"}, {"data", json::array({model})}};
    res.set_content(dump(body), "application/json");
  });

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (shutting_down_.load())
      return send_error(res, ApiError{.status = 503, .message = "the server is shutting down",
                                      .type = "service_unavailable_error", .code = "shutting_down"});
    if (!ready_.load(std::memory_order_acquire))
      return send_error(res, ApiError{.status = 503, .message = "the model is still loading",
                                      .type = "service_unavailable_error", .code = "loading"});
    res.status = 200;  // vLLM: 200 with an empty body
  });

  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const EngineSnapshot snap = ready_.load(std::memory_order_acquire) ? model_.engine->snapshot() : EngineSnapshot{};
    res.set_content(metrics_.render(snap), "text/plain; version=0.0.4; charset=utf-8");
  });

  auto tokens_route = [this, admit](bool encode) {
    return [this, admit, encode](const httplib::Request& req, httplib::Response& res, const std::string& body) {
      if (!admit(req, res, true)) return;
      auto out = encode ? tokenize(body, model_.info) : detokenize(body, model_.info);
      if (auto* e = std::get_if<ApiError>(&out)) return send_error(res, *e);
      res.set_content(dump(std::get<json>(out)), "application/json");
    };
  };
  post("/tokenize", tokens_route(true));
  post("/detokenize", tokens_route(false));
}

}  // namespace moat::server
