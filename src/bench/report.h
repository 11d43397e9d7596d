// What `moat bench` prints and writes: an sglang-bench_serving-style summary per concurrency, a
// seed-style sweep table (per-stream tok/s, aggregate tok/s, TTFT, cost), a JSON array with one
// record per concurrency (read by `moat plan --measured`) and the same records as CSV.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/metrics.h"

namespace moat::bench {

// Describes the run, copied into every JSON/CSV record so a file stands on its own.
struct RunContext {
  std::string base_url, model, endpoint;  // endpoint: "completions" or "chat"
  int64_t input_len = 0, output_len = 0;
  double range_ratio = 1;
  int num_prompts = 0;
  bool exact_input_tokens = false;  // a tokenizer built the prompts
  double server_tokens_per_word = 0;  // measured on the server to size word prompts; 0: not done
};

void print_summary(std::FILE* out, const Metrics& m, const RunContext& ctx);
void print_sweep_table(std::FILE* out, const std::vector<Metrics>& sweep);

nlohmann::json to_json(const Metrics& m, const RunContext& ctx);
nlohmann::json to_json(const std::vector<Metrics>& sweep, const RunContext& ctx);

Status write_json(const std::string& path, const std::vector<Metrics>& sweep, const RunContext& ctx);
Status write_csv(const std::string& path, const std::vector<Metrics>& sweep, const RunContext& ctx);

}  // namespace moat::bench
