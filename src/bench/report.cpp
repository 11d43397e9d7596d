#include "bench/report.h"

#include <cmath>
#include <fstream>

namespace moat::bench {

namespace {

using nlohmann::json;

std::string rate_text(double rate) { return std::isfinite(rate) ? fmt::format("{:.2f}", rate) : "inf"; }

void line(std::FILE* out, const std::string& label, const std::string& value) {
  std::fprintf(out, "%-40s %-10s\n", label.c_str(), value.c_str());
}
void line(std::FILE* out, const std::string& label, double value) {
  line(out, label, fmt::format("{:.2f}", value));
}
void banner(std::FILE* out, const std::string& title, char fill) {
  // Centred like Python's "{:=^50}", which sglang uses for its section rules.
  size_t pad = title.size() < 50 ? 50 - title.size() : 0;
  std::string s = std::string(pad / 2, fill) + title + std::string(pad - pad / 2, fill);
  std::fprintf(out, "%s\n", s.c_str());
}

json stat_json(const Stat& s) {
  return {{"mean", s.mean}, {"median", s.median}, {"p99", s.p99}, {"std", s.stddev}, {"max", s.max}};
}

}  // namespace

void print_summary(std::FILE* out, const Metrics& m, const RunContext& ctx) {
  banner(out, m.interrupted ? " Serving Benchmark Result (interrupted) " : " Serving Benchmark Result ", '=');
  line(out, "Endpoint:", ctx.endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions");
  line(out, "Traffic request rate:", rate_text(m.request_rate));
  line(out, "Max request concurrency:", m.concurrency > 0 ? std::to_string(m.concurrency) : "not set");
  line(out, "Successful requests:", std::to_string(m.completed));
  line(out, "Failed requests:", std::to_string(m.failed));
  if (m.cancelled) line(out, "Cancelled requests:", std::to_string(m.cancelled));
  // Not failures: the server closed a kept-alive connection under these before answering.
  if (m.resent) line(out, "Resent on a fresh connection:", std::to_string(m.resent));
  line(out, "Benchmark duration (s):", m.duration_s);
  line(out, ctx.exact_input_tokens ? "Total input tokens:" : "Total input tokens (approx.):",
       std::to_string(m.total_input_tokens));
  line(out, "Total generated tokens:", std::to_string(m.total_output_tokens));
  line(out, "Request throughput (req/s):", m.request_tps);
  line(out, "Input token throughput (tok/s):", m.input_tps);
  line(out, "Output token throughput (tok/s):", m.output_tps);
  line(out, "Total token throughput (tok/s):", m.total_tps);
  line(out, "Concurrency:", m.measured_concurrency);
  line(out, "Per-stream decode (tok/s, 1/TPOT):", m.per_stream_tps);
  if (m.cost.gpus > 0) {
    banner(out, "Cost", '-');
    line(out, "GPUs x price per GPU-hour (USD):",
         fmt::format("{} x {:.2f}", m.cost.gpus, m.cost.price_per_gpu_hour));
    line(out, "Output tok/s per GPU:", m.output_tps_per_gpu);
    line(out, "Output tok/s per GPU-hour dollar:", m.tps_per_gpu_hour_dollar);
    line(out, "USD per million output tokens:", m.usd_per_mtok);
  }
  auto section = [&](const char* title, const char* name, const Stat& s) {
    banner(out, title, '-');
    line(out, fmt::format("Mean {} (ms):", name), s.mean);
    line(out, fmt::format("Median {} (ms):", name), s.median);
    line(out, fmt::format("P99 {} (ms):", name), s.p99);
  };
  section("End-to-End Latency", "E2E Latency", m.e2e_ms);
  section("Time to First Token", "TTFT", m.ttft_ms);
  section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms);
  section("Inter-Token Latency", "ITL", m.itl_ms);
  line(out, "Max ITL (ms):", m.itl_ms.max);
  if (!m.first_error.empty()) {
    banner(out, "First error", '-');
    std::fprintf(out, "%s\n", m.first_error.c_str());
  }
  banner(out, "", '=');
}

void print_sweep_table(std::FILE* out, const std::vector<Metrics>& sweep) {
  bool cost = !sweep.empty() && sweep.front().cost.gpus > 0;
  std::fprintf(out, "%11s %8s %14s %14s %12s %12s", "concurrency", "failed", "tok/s/stream",
               "aggregate tok/s", "TTFT mean ms", "TTFT p99 ms");
  if (cost) std::fprintf(out, " %12s %14s %10s", "tok/s/GPU", "tok/s per $/h", "$/Mtok");
  std::fprintf(out, "\n");
  for (const Metrics& m : sweep) {
    std::string c = m.concurrency > 0 ? std::to_string(m.concurrency) : "inf";
    std::fprintf(out, "%11s %8lld %14.1f %15.1f %12.1f %12.1f", c.c_str(),
                 static_cast<long long>(m.failed), m.per_stream_tps, m.output_tps, m.ttft_ms.mean,
                 m.ttft_ms.p99);
    if (cost)
      std::fprintf(out, " %12.1f %14.1f %10.3f", m.output_tps_per_gpu, m.tps_per_gpu_hour_dollar,
                   m.usd_per_mtok);
    std::fprintf(out, "%s\n", m.interrupted ? "  (interrupted)" : "");
  }
}

json to_json(const Metrics& m, const RunContext& ctx) {
  json j;
  j["concurrency"] = m.concurrency;
  j["request_rate"] = std::isfinite(m.request_rate) ? json(m.request_rate) : json(nullptr);
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["cancelled"] = m.cancelled;
  j["resent"] = m.resent;
  j["first_error"] = m.first_error.empty() ? json(nullptr) : json(m.first_error);
  j["interrupted"] = m.interrupted;
  j["duration_s"] = m.duration_s;
  j["total_input_tokens"] = m.total_input_tokens;
  j["total_output_tokens"] = m.total_output_tokens;
  j["request_tps"] = m.request_tps;
  j["input_tps"] = m.input_tps;
  j["output_tps"] = m.output_tps;
  j["total_tps"] = m.total_tps;
  j["measured_concurrency"] = m.measured_concurrency;
  j["per_stream_tps"] = m.per_stream_tps;
  j["ttft_ms"] = stat_json(m.ttft_ms);
  j["tpot_ms"] = stat_json(m.tpot_ms);
  j["itl_ms"] = stat_json(m.itl_ms);
  j["e2e_ms"] = stat_json(m.e2e_ms);
  if (m.cost.gpus > 0) {
    j["gpus"] = m.cost.gpus;
    j["price_per_gpu_hour"] = m.cost.price_per_gpu_hour;
    j["output_tps_per_gpu"] = m.output_tps_per_gpu;
    j["tps_per_gpu_hour_dollar"] = m.tps_per_gpu_hour_dollar;
    j["usd_per_mtok"] = m.usd_per_mtok;
  }
  j["base_url"] = ctx.base_url;
  j["model"] = ctx.model;
  j["endpoint"] = ctx.endpoint;
  j["input_len"] = ctx.input_len;
  j["output_len"] = ctx.output_len;
  j["range_ratio"] = ctx.range_ratio;
  j["num_prompts"] = ctx.num_prompts;
  j["exact_input_tokens"] = ctx.exact_input_tokens;
  if (ctx.server_tokens_per_word > 0) j["server_tokens_per_word"] = ctx.server_tokens_per_word;
  return j;
}

json to_json(const std::vector<Metrics>& sweep, const RunContext& ctx) {
  json arr = json::array();
  for (const Metrics& m : sweep) arr.push_back(to_json(m, ctx));
  return arr;
}

Status write_json(const std::string& path, const std::vector<Metrics>& sweep, const RunContext& ctx) {
  std::ofstream out(path);
  if (!out) return make_error("--json {}: cannot open for writing", path);
  out << to_json(sweep, ctx).dump(2) << "\n";
  if (!out) return make_error("--json {}: write failed", path);
  return ok_status();
}

Status write_csv(const std::string& path, const std::vector<Metrics>& sweep, const RunContext& ctx) {
  std::ofstream out(path);
  if (!out) return make_error("--csv {}: cannot open for writing", path);
  // Flattens the JSON record: nested stats become ttft_ms_mean, ttft_ms_median, ...
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
  for (const Metrics& m : sweep) {
    json j = to_json(m, ctx);
    std::vector<std::string> row;
    std::vector<std::string> cols;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.value().is_object()) {
        for (auto s = it.value().begin(); s != it.value().end(); ++s) {
          cols.push_back(it.key() + "_" + s.key());
          row.push_back(s.value().dump());
        }
      } else {
        cols.push_back(it.key());
        std::string v = it.value().is_string() ? it.value().get<std::string>()
                        : it.value().is_null() ? ""
                                               : it.value().dump();
        if (v.find_first_of(",\"\n") != std::string::npos) {
          std::string q = "\"";
          for (char c : v) q += c == '"' ? std::string("\"\"") : std::string(1, c);
          v = q + "\"";
        }
        row.push_back(v);
      }
    }
    if (columns.empty()) columns = cols;
    rows.push_back(row);
  }
  for (size_t i = 0; i < columns.size(); ++i) out << (i ? "," : "") << columns[i];
  out << "\n";
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) out << (i ? "," : "") << row[i];
    out << "\n";
  }
  if (!out) return make_error("--csv {}: write failed", path);
  return ok_status();
}

}  // namespace moat::bench
