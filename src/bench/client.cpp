#include "bench/client.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <chrono>

namespace moat::bench {

namespace {

using nlohmann::json;

// The server's own words for an error, from the shapes OpenAI, vLLM and sglang use:
// {"error": {"message": ...}}, {"error": "..."}, {"object": "error", "message": ...}.
std::string error_message(const json& j) {
  if (j.contains("error")) {
    const json& e = j["error"];
    if (e.is_string()) return e.get<std::string>();
    if (e.is_object() && e.contains("message") && e["message"].is_string())
      return e["message"].get<std::string>();
    return e.dump();
  }
  if (j.value("object", "") == "error")
    return j.contains("message") && j["message"].is_string() ? j["message"].get<std::string>()
                                                             : j.dump();
  return {};
}

std::string text_of_choice(const json& choice, bool chat) {
  std::string out;
  auto append = [&out](const json& obj, const char* key) {
    if (obj.is_object() && obj.contains(key) && obj[key].is_string())
      out += obj[key].get<std::string>();
  };
  if (chat) {
    // Reasoning models stream their thinking separately; it is output the server generated.
    const json& d = choice.contains("delta") ? choice["delta"] : choice["message"];
    append(d, "reasoning_content");
    append(d, "reasoning");
    append(d, "content");
  } else {
    append(choice, "text");
  }
  return out;
}

void read_usage(const json& j, RequestRecord& r) {
  if (!j.contains("usage") || !j["usage"].is_object()) return;
  const json& u = j["usage"];
  if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
    r.prompt_tokens = u["prompt_tokens"].get<int64_t>();
  if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
    r.completion_tokens = u["completion_tokens"].get<int64_t>();
}

std::string shorten(std::string s, size_t n = 300) {
  if (s.size() > n) s = s.substr(0, n) + "...";
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

Result<ParsedUrl> parse_base_url(const std::string& base_url) {
  size_t scheme_end = base_url.find("://");
  if (scheme_end == std::string::npos)
    return make_error("--base-url {}: expected http://host:port or https://host:port", base_url);
  std::string scheme = base_url.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https")
    return make_error("--base-url {}: scheme must be http or https", base_url);
  size_t host_start = scheme_end + 3;
  size_t path_start = base_url.find('/', host_start);
  ParsedUrl p;
  p.scheme_host_port = base_url.substr(0, path_start);
  if (p.scheme_host_port.size() <= host_start)
    return make_error("--base-url {}: no host", base_url);
  std::string prefix = path_start == std::string::npos ? "" : base_url.substr(path_start);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (prefix.size() >= 3 && prefix.compare(prefix.size() - 3, 3, "/v1") == 0)
    prefix.resize(prefix.size() - 3);
  p.prefix = prefix;
  return p;
}

std::string request_path(const EndpointConfig& endpoint) {
  auto url = parse_base_url(endpoint.base_url);
  std::string prefix = url.ok() ? url->prefix : "";
  return prefix + (endpoint.chat ? "/v1/chat/completions" : "/v1/completions");
}

std::string request_body(const EndpointConfig& endpoint, const BenchRequest& request) {
  json body;
  if (!endpoint.model.empty()) body["model"] = endpoint.model;
  if (endpoint.chat) {
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt}}});
  } else {
    body["prompt"] = request.prompt;
  }
  body["max_tokens"] = request.output_tokens;
  body["temperature"] = 0.0;
  body["stream"] = true;
  // Asks for token counts in the last chunk; servers that ignore it are counted by chunks.
  body["stream_options"] = {{"include_usage", true}};
  if (endpoint.ignore_eos) body["ignore_eos"] = true;
  return body.dump();
}

Result<std::string> fetch_model_id(const EndpointConfig& endpoint) {
  MOAT_ASSIGN_OR_RETURN(ParsedUrl url, parse_base_url(endpoint.base_url));
  httplib::Client cli(url.scheme_host_port);
  cli.set_connection_timeout(10);
  cli.set_read_timeout(30);
  httplib::Headers headers;
  if (!endpoint.api_key.empty()) headers.emplace("Authorization", "Bearer " + endpoint.api_key);
  auto res = cli.Get(url.prefix + "/v1/models", headers);
  if (!res) return make_error("GET {}/v1/models: {}", endpoint.base_url, httplib::to_string(res.error()));
  if (res->status != 200)
    return make_error("GET {}/v1/models: HTTP {}: {}", endpoint.base_url, res->status, shorten(res->body));
  json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id"))
    return make_error("GET {}/v1/models: expected {{\"data\": [{{\"id\": ...}}]}}", endpoint.base_url);
  return j["data"][0]["id"].get<std::string>();
}

struct StreamingClient::Attempt {
  RequestRecord rec;
  httplib::Error transport = httplib::Error::Success;  // Success unless httplib failed
  bool reused_connection = false;
};

StreamingClient::StreamingClient(EndpointConfig endpoint, std::string path,
                                 std::unique_ptr<httplib::Client> cli)
    : endpoint_(std::move(endpoint)), path_(std::move(path)), cli_(std::move(cli)) {
  cli_->set_socket_options([this](int) { connections_opened_.fetch_add(1); });
}

StreamingClient::~StreamingClient() = default;

Result<std::unique_ptr<StreamingClient>> StreamingClient::create(const EndpointConfig& endpoint) {
  MOAT_ASSIGN_OR_RETURN(ParsedUrl url, parse_base_url(endpoint.base_url));
  auto cli = std::make_unique<httplib::Client>(url.scheme_host_port);
  if (!cli->is_valid()) return make_error("--base-url {}: not a valid URL", endpoint.base_url);
  cli->set_keep_alive(true);
  cli->set_tcp_nodelay(true);  // request headers and body go out as separate writes
  cli->set_connection_timeout(10);
  auto timeout = std::chrono::duration<double>(endpoint.timeout_s);
  cli->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  cli->set_write_timeout(60);
  std::string path = request_path(endpoint);
  return std::unique_ptr<StreamingClient>(
      new StreamingClient(endpoint, std::move(path), std::move(cli)));
}

void StreamingClient::stop() { cli_->stop(); }

RequestRecord StreamingClient::send(const BenchRequest& request, const std::atomic<bool>* cancel) {
  Attempt a = send_once(request, cancel);
  // Read/Write: the socket failed under us. No status line yet: the server answered nothing, so
  // resending cannot count a request twice that the server has begun to answer.
  bool lost_on_stale_connection =
      !a.rec.success && !a.rec.cancelled && a.reused_connection && a.rec.http_status == 0 &&
      (a.transport == httplib::Error::Read || a.transport == httplib::Error::Write);
  if (!lost_on_stale_connection) return std::move(a.rec);
  // httplib has closed the failed socket, so this attempt connects afresh; and a server that
  // closes connections under requests gains nothing from keep-alive but lost requests.
  cli_->set_keep_alive(false);
  Attempt again = send_once(request, cancel);
  again.rec.resent = a.rec.resent + 1;
  return std::move(again.rec);
}

StreamingClient::Attempt StreamingClient::send_once(const BenchRequest& request,
                                                    const std::atomic<bool>* cancel) {
  Attempt attempt;
  RequestRecord& rec = attempt.rec;
  rec.expected_input_tokens = request.input_tokens;
  bool done = false;
  std::string error_body;  // non-2xx bodies, kept short
  SseSplitter sse;

  auto on_data = [&](std::string_view data) {
    if (!rec.error.empty()) return;
    if (data == "[DONE]") {
      done = true;
      return;
    }
    double now = monotonic_s();
    json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      rec.error = "unparseable stream chunk: " + shorten(std::string(data));
      return;
    }
    if (std::string e = error_message(j); !e.empty()) {
      rec.error = "error in stream: " + shorten(e);
      return;
    }
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      std::string text = text_of_choice(j["choices"][0], endpoint_.chat);
      // Empty chunks (role-only deltas, keep-alives) are not tokens: they must not count as TTFT.
      if (!text.empty()) {
        rec.chunk_s.push_back(now);
        rec.text += text;
      }
    }
    read_usage(j, rec);
  };

  httplib::Request req;
  req.method = "POST";
  req.path = path_;
  req.body = request_body(endpoint_, request);
  req.headers.emplace("Content-Type", "application/json");
  req.headers.emplace("Accept", "text/event-stream");
  if (!endpoint_.api_key.empty())
    req.headers.emplace("Authorization", "Bearer " + endpoint_.api_key);
  req.response_handler = [&](const httplib::Response& res) {
    rec.http_status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (cancel && cancel->load(std::memory_order_relaxed)) return false;
    if (rec.http_status < 200 || rec.http_status >= 300) {
      if (error_body.size() < 4096) error_body.append(data, n);
      return true;
    }
    sse.feed(std::string_view(data, n), on_data);
    // Stop reading after an error in the stream: the request has already failed.
    return rec.error.empty();
  };

  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const int64_t opened_before = connections_opened_.load();
  rec.send_s = monotonic_s();
  bool sent = cli_->send(req, res, err);
  rec.end_s = monotonic_s();
  attempt.reused_connection = connections_opened_.load() == opened_before;
  if (!sent) attempt.transport = err;

  if (cancel && cancel->load(std::memory_order_relaxed)) {
    rec.cancelled = true;
    return attempt;
  }
  if (!rec.error.empty()) return attempt;  // mid-stream error, already described
  if (rec.http_status != 0 && (rec.http_status < 200 || rec.http_status >= 300)) {
    json j = json::parse(error_body, nullptr, false);
    std::string msg = j.is_discarded() ? error_body : error_message(j);
    if (msg.empty()) msg = error_body;
    rec.error = fmt::format("HTTP {}: {}", rec.http_status, shorten(msg));
    return attempt;
  }
  if (!sent) {
    rec.error = "transport error: " + httplib::to_string(err);
    return attempt;
  }
  if (!sse.saw_data()) {
    // A server that ignored "stream": true answers with one JSON body: one chunk at the end.
    json j = json::parse(sse.pending(), nullptr, false);
    if (!j.is_discarded() && j.contains("choices") && j["choices"].is_array() &&
        !j["choices"].empty()) {
      std::string text = text_of_choice(j["choices"][0], endpoint_.chat);
      if (!text.empty()) {
        rec.chunk_s.push_back(rec.end_s);
        rec.text = text;
      }
      read_usage(j, rec);
    }
  }
  if (rec.chunk_s.empty()) {
    rec.error = done ? "the stream ended without any text" : "empty response (no SSE data)";
    return attempt;
  }
  rec.success = true;
  return attempt;
}

}  // namespace moat::bench
