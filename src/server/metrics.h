// /metrics: Prometheus text exposition (format 0.0.4) with vLLM's metric names under a `moat:`
// prefix (vllm:num_requests_running -> moat:num_requests_running, ...). Engine-side figures
// (running, waiting, KV blocks, prefix-cache counters, preemptions, tokens computed) come from
// the AsyncEngine's snapshot; request-side ones (TTFT, inter-token latency, end-to-end latency,
// finish reasons, tokens per request, HTTP statuses) are recorded by the server as requests end.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "engine/async_engine.h"

namespace moat::server {

// A Prometheus histogram: counts per upper bound (le), plus sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // `labels` are rendered inside the braces before le, e.g. model_name="k3-nano".
  void render(std::string& out, std::string_view name, std::string_view help, std::string_view labels) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // [bounds + 1], not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What one finished engine request contributes (one per choice).
struct FinishedRequest {
  FinishReason reason = FinishReason::none;
  bool client_gone = false;         // aborted because the client disconnected
  double ttft_s = -1;               // < 0: no token was produced
  std::vector<double> itl_s;        // gaps between successive token outputs
  double e2e_s = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, cached_tokens = 0;
};

class ServerMetrics {
 public:
  explicit ServerMetrics(std::string model_name);
  void record(const FinishedRequest& r);
  void record_http(int status);
  std::string render(const EngineSnapshot& snap) const;
  int64_t client_disconnects() const;

 private:
  std::string labels_;  // model_name="..."
  mutable std::mutex mu_;
  Histogram ttft_, itl_, e2e_, prompt_len_, generation_len_;
  std::map<std::string, uint64_t> finished_;  // by finish reason
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0, cached_tokens_ = 0, client_disconnects_ = 0;
  std::map<int, uint64_t> http_;  // by status
};

// Prometheus label value escaping (backslash, double quote, newline).
std::string prometheus_escape(std::string_view value);

}  // namespace moat::server
