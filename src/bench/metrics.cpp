#include "bench/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moat::bench {

int64_t RequestRecord::output_tokens() const {
  return completion_tokens >= 0 ? completion_tokens : static_cast<int64_t>(chunk_s.size());
}

int64_t RequestRecord::input_tokens() const {
  return prompt_tokens >= 0 ? prompt_tokens : expected_input_tokens;
}

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  // numpy "linear": rank = q/100 * (n - 1), interpolate between floor and ceil.
  double rank = q / 100.0 * static_cast<double>(values.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(rank));
  size_t hi = std::min(lo + 1, values.size() - 1);
  double frac = rank - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

Stat summarize(const std::vector<double>& values) {
  Stat s;
  if (values.empty()) return s;
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  double var = 0;
  for (double v : values) var += (v - s.mean) * (v - s.mean);
  s.stddev = std::sqrt(var / static_cast<double>(values.size()));  // numpy's default ddof=0
  s.median = percentile(values, 50);
  s.p99 = percentile(values, 99);
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

double tps_per_gpu_hour_dollar(double output_tps, int gpus, double price_per_gpu_hour) {
  double dollars_per_hour = gpus * price_per_gpu_hour;
  return dollars_per_hour > 0 ? output_tps / dollars_per_hour : 0;
}

double usd_per_mtok(double output_tps, int gpus, double price_per_gpu_hour) {
  if (output_tps <= 0) return 0;
  double dollars_per_second = gpus * price_per_gpu_hour / 3600.0;
  return dollars_per_second / output_tps * 1e6;
}

Metrics compute_metrics(const std::vector<RequestRecord>& records, double duration_s,
                        int concurrency, double request_rate, const CostInputs& cost) {
  Metrics m;
  m.concurrency = concurrency;
  m.request_rate = request_rate;
  m.duration_s = duration_s;
  m.cost = cost;
  std::vector<double> ttft, tpot, itl, e2e;
  double first_error_time = std::numeric_limits<double>::infinity();
  double sum_e2e_s = 0;
  for (const RequestRecord& r : records) {
    if (r.resent > 0) ++m.resent;
    if (r.cancelled) {
      ++m.cancelled;
      continue;
    }
    if (!r.success) {
      ++m.failed;
      // "First" in wall-clock order, which is what a user watching the run would have seen.
      if (r.end_s < first_error_time) {
        first_error_time = r.end_s;
        m.first_error = r.error;
      }
      continue;
    }
    ++m.completed;
    int64_t out = r.output_tokens();
    m.total_output_tokens += out;
    m.total_input_tokens += r.input_tokens();
    if (r.chunk_s.empty()) continue;  // a success with no text has no latency to report
    double first = r.chunk_s.front() - r.send_s;
    double last = r.chunk_s.back() - r.send_s;
    ttft.push_back(first * 1e3);
    e2e.push_back(last * 1e3);
    sum_e2e_s += last;
    if (out > 1) tpot.push_back((last - first) / static_cast<double>(out - 1) * 1e3);
    for (size_t i = 1; i < r.chunk_s.size(); ++i)
      itl.push_back((r.chunk_s[i] - r.chunk_s[i - 1]) * 1e3);
  }
  m.ttft_ms = summarize(ttft);
  m.tpot_ms = summarize(tpot);
  m.itl_ms = summarize(itl);
  m.e2e_ms = summarize(e2e);
  if (duration_s > 0) {
    m.request_tps = static_cast<double>(m.completed) / duration_s;
    m.input_tps = static_cast<double>(m.total_input_tokens) / duration_s;
    m.output_tps = static_cast<double>(m.total_output_tokens) / duration_s;
    m.total_tps = m.input_tps + m.output_tps;
    m.measured_concurrency = sum_e2e_s / duration_s;
  }
  m.per_stream_tps = m.tpot_ms.mean > 0 ? 1e3 / m.tpot_ms.mean : 0;
  if (cost.gpus > 0) {
    m.output_tps_per_gpu = m.output_tps / cost.gpus;
    m.tps_per_gpu_hour_dollar = tps_per_gpu_hour_dollar(m.output_tps, cost.gpus,
                                                        cost.price_per_gpu_hour);
    m.usd_per_mtok = usd_per_mtok(m.output_tps, cost.gpus, cost.price_per_gpu_hour);
  }
  return m;
}

}  // namespace moat::bench
