// Serving-benchmark metrics, exactly as ../shared/DESIGN.md ("Benchmark metrics") defines them so
// that numbers are comparable with sglang bench_serving and vllm bench serve:
//   TTFT = send -> first non-empty chunk;  ITL = gap between consecutive non-empty chunks;
//   TPOT = (E2E - TTFT) / (output_tokens - 1);  E2E = send -> last non-empty chunk;
//   output throughput = output tokens / duration;  concurrency = sum(E2E) / duration;
//   per-stream decode tok/s = 1 / TPOT.
// Everything here is a pure function of recorded timings, so it is tested without a server.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moat::bench {

// One request as the client saw it. Times are seconds on the run's steady clock.
struct RequestRecord {
  bool success = false;
  bool cancelled = false;   // aborted by Ctrl-C: neither a success nor a failure
  std::string error;        // first error message (HTTP body, mid-stream error, transport)
  int http_status = 0;
  double send_s = 0;
  double end_s = 0;                 // when the response finished, successful or not
  std::vector<double> chunk_s;      // arrival of every non-empty chunk
  int64_t prompt_tokens = -1;       // from the server's usage, -1 when absent
  int64_t completion_tokens = -1;   // from the server's usage, -1 when absent
  int64_t expected_input_tokens = 0;  // what the workload built (exact with a tokenizer)
  std::string text;                 // generated text, for debugging and retokenising
  // Times the request was sent again on a fresh connection because the server had closed the
  // kept-alive one under it before answering (send_s is the last sending: the server saw only it).
  int resent = 0;

  // Usage when the server reports it; otherwise one token per non-empty chunk.
  int64_t output_tokens() const;
  int64_t input_tokens() const;
};

struct Stat {
  double mean = 0, median = 0, p99 = 0, stddev = 0, max = 0;
};

// Linear interpolation between closest ranks, numpy.percentile's default. q in [0, 100].
double percentile(std::vector<double> values, double q);
Stat summarize(const std::vector<double>& values);

struct CostInputs {
  int gpus = 0;                    // 0: no cost columns
  double price_per_gpu_hour = 0;   // USD
};

// Aggregate tok/s per GPU-hour dollar: output_tps / (gpus * price). Seed: 952 / (8 * 2.5) = 47.6.
double tps_per_gpu_hour_dollar(double output_tps, int gpus, double price_per_gpu_hour);
// Dollars per million output tokens at that throughput.
double usd_per_mtok(double output_tps, int gpus, double price_per_gpu_hour);

struct Metrics {
  int concurrency = 0;             // the limit asked for; 0 = unlimited
  double request_rate = 0;         // requests/s asked for; infinity = all at once
  int64_t completed = 0, failed = 0, cancelled = 0;
  int64_t resent = 0;  // requests resent on a fresh connection (see RequestRecord::resent)
  std::string first_error;
  bool interrupted = false;
  double duration_s = 0;
  int64_t total_input_tokens = 0, total_output_tokens = 0;
  double request_tps = 0, input_tps = 0, output_tps = 0, total_tps = 0;
  double measured_concurrency = 0;  // sum(E2E) / duration
  double per_stream_tps = 0;        // 1 / mean TPOT
  Stat ttft_ms, tpot_ms, itl_ms, e2e_ms;
  CostInputs cost;
  // Filled when cost.gpus > 0.
  double output_tps_per_gpu = 0, tps_per_gpu_hour_dollar = 0, usd_per_mtok = 0;
};

Metrics compute_metrics(const std::vector<RequestRecord>& records, double duration_s,
                        int concurrency, double request_rate, const CostInputs& cost);

}  // namespace moat::bench
