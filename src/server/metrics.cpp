#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace moat::server {
namespace {

// vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read these as well.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                         0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kE2eBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,  15.0,  20.0,
                                         30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
// 1, 2, 5 x powers of ten up to a million tokens.
std::vector<double> length_buckets() {
  std::vector<double> b;
  for (double p = 1; p <= 1e6; p *= 10)
    for (double m : {1.0, 2.0, 5.0}) b.push_back(m * p);
  return b;
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void sample(std::string& out, std::string_view name, std::string_view labels, double value) {
  out += fmt::format("{}{{{}}} {}\n", name, labels, value);
}

void metric(std::string& out, std::string_view name, std::string_view type, std::string_view help,
            std::string_view labels, double value) {
  header(out, name, type, help);
  sample(out, name, labels, value);
}

}  // namespace

std::string prometheus_escape(std::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, std::string_view name, std::string_view help, std::string_view labels) const {
  header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, count_);
  out += fmt::format("{}_sum{{{}}} {}\n", name, labels, sum_);
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, count_);
}

ServerMetrics::ServerMetrics(std::string model_name)
    : labels_(fmt::format("model_name=\"{}\"", prometheus_escape(model_name))),
      ttft_(kTtftBuckets),
      itl_(kItlBuckets),
      e2e_(kE2eBuckets),
      prompt_len_(length_buckets()),
      generation_len_(length_buckets()) {
  for (const char* r : {"stop", "length", "abort"}) finished_[r] = 0;
}

void ServerMetrics::record(const FinishedRequest& r) {
  std::lock_guard lock(mu_);
  ++finished_[std::string(finish_reason_name(r.reason))];
  if (r.client_gone) ++client_disconnects_;
  if (r.ttft_s >= 0) ttft_.observe(r.ttft_s);
  for (double gap : r.itl_s) itl_.observe(gap);
  e2e_.observe(r.e2e_s);
  prompt_len_.observe(static_cast<double>(r.prompt_tokens));
  generation_len_.observe(static_cast<double>(r.generation_tokens));
  prompt_tokens_ += r.prompt_tokens;
  generation_tokens_ += r.generation_tokens;
  cached_tokens_ += r.cached_tokens;
}

void ServerMetrics::record_http(int status) {
  std::lock_guard lock(mu_);
  ++http_[status];
}

int64_t ServerMetrics::client_disconnects() const {
  std::lock_guard lock(mu_);
  return static_cast<int64_t>(client_disconnects_);
}

std::string ServerMetrics::render(const EngineSnapshot& s) const {
  std::string out;
  const std::string_view L = labels_;
  metric(out, "moat:num_requests_running", "gauge", "Requests in the engine's running batch.", L, s.running);
  metric(out, "moat:num_requests_waiting", "gauge", "Requests accepted and not yet running (queued or preempted).", L,
         s.waiting);
  metric(out, "moat:kv_cache_blocks_used", "gauge", "KV cache blocks held by requests.", L, s.kv_blocks_used);
  metric(out, "moat:kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.", L, s.kv_blocks_total);
  metric(out, "moat:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).", L,
         s.kv_blocks_total > 0 ? static_cast<double>(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
  metric(out, "moat:kv_cache_block_size", "gauge", "Tokens per KV cache block.", L, s.block_size);
  metric(out, "moat:prefix_cache_queries_total", "counter", "Full prompt blocks looked up in the prefix cache.", L,
         s.prefix_block_lookups);
  metric(out, "moat:prefix_cache_hits_total", "counter", "Prompt blocks found in the prefix cache.", L,
         s.prefix_block_hits);
  metric(out, "moat:prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total (0 before any).",
         L, s.prefix_block_lookups > 0 ? static_cast<double>(s.prefix_block_hits) / s.prefix_block_lookups : 0.0);
  metric(out, "moat:num_preemptions_total", "counter", "Requests preempted (their KV blocks freed, recomputed later).", L,
         s.preemptions);
  metric(out, "moat:prompt_tokens_computed_total", "counter",
         "Prompt tokens the model computed (prefix-cache hits excluded, recomputation after preemption included).", L,
         s.prompt_tokens_computed);
  metric(out, "moat:engine_steps_total", "counter", "Engine steps run.", L, s.steps);
  // vLLM's spec_decode counter names
  metric(out, "moat:spec_decode_num_drafts_total", "counter", "Speculative verifications (one per request and step).", L,
         s.spec_steps);
  metric(out, "moat:spec_decode_num_draft_tokens_total", "counter", "Speculative tokens proposed and verified.", L,
         s.draft_tokens);
  metric(out, "moat:spec_decode_num_accepted_tokens_total", "counter", "Speculative tokens accepted.", L,
         s.accepted_tokens);

  std::lock_guard lock(mu_);
  metric(out, "moat:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", L, prompt_tokens_);
  // The engine's own count moves every step; the per-request sum only when requests end.
  metric(out, "moat:generation_tokens_total", "counter", "Tokens generated (every step, all requests).", L,
         s.generated_tokens);
  metric(out, "moat:prompt_tokens_cached_total", "counter", "Prompt tokens of finished requests found in the prefix cache.",
         L, cached_tokens_);
  header(out, "moat:request_success_total", "counter", "Finished requests by finish reason.");
  for (const auto& [reason, n] : finished_)
    sample(out, "moat:request_success_total", fmt::format("{},finished_reason=\"{}\"", L, reason), static_cast<double>(n));
  metric(out, "moat:request_client_disconnects_total", "counter",
         "Requests aborted because their client disconnected before the end.", L, client_disconnects_);
  ttft_.render(out, "moat:time_to_first_token_seconds", "Time from receiving the request to its first token.", L);
  itl_.render(out, "moat:inter_token_latency_seconds", "Time between successive tokens of a request.", L);
  e2e_.render(out, "moat:e2e_request_latency_seconds", "Time from receiving the request to its end.", L);
  prompt_len_.render(out, "moat:request_prompt_tokens", "Prompt tokens per finished request.", L);
  generation_len_.render(out, "moat:request_generation_tokens", "Generated tokens per finished request.", L);
  header(out, "moat:http_responses_total", "counter", "HTTP responses by status code.");
  for (const auto& [status, n] : http_)
    sample(out, "moat:http_responses_total", fmt::format("{},status=\"{}\"", L, status), static_cast<double>(n));
  return out;
}

}  // namespace moat::server
