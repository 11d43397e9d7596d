// `moat bench`: serving benchmark against any OpenAI-compatible server (moat, vLLM, sglang,
// llama-server), with the metric definitions of ../shared/DESIGN.md ("Benchmark metrics").
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "base/log.h"
#include "bench/calibrate.h"
#include "bench/client.h"
#include "bench/metrics.h"
#include "bench/plot.h"
#include "bench/report.h"
#include "bench/runner.h"
#include "bench/workload.h"
#include "cli/command.h"

namespace moat::cli {
namespace {

std::atomic<bool> g_interrupted{false};

int fail(int exit_code, const std::string& message) {
  MOAT_LOG(error, "{}", message);
  return exit_code;
}

void on_sigint(int) {
  g_interrupted.store(true);
  // A second Ctrl-C kills the process the usual way.
  std::signal(SIGINT, SIG_DFL);
}

struct BenchFlags {
  std::string base_url, model, api_key, endpoint = "completions";
  int num_prompts = 0;
  int prompts_per_stream = 0;
  int64_t input_len = 1024, output_len = 128;
  double range_ratio = 1.0;
  std::string dataset, tokenizer;
  std::string concurrency = "1";
  std::string request_rate = "inf";
  int warmup = -1;  // one per worker
  uint64_t seed = 1;
  std::string json_path, csv_path, plot_path;
  bool ignore_eos = true;
  int gpus = 0;
  double price = 0;
  double timeout_s = 3600;
  bool no_progress = false;
  bool calibrate = true;
};

Result<std::vector<int>> parse_concurrency(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item == "inf" || item == "0") {
      out.push_back(0);
      continue;
    }
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0)
      return make_error("--concurrency {}: expected a comma-separated list of positive integers "
                        "(or inf), e.g. 1,4,16,64", text);
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) return make_error("--concurrency: empty list");
  return out;
}

Result<double> parse_rate(const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v > 0))
    return make_error("--request-rate {}: expected a positive number of requests/s or inf", text);
  return v;
}

int run(const BenchFlags& f) {
  auto levels = parse_concurrency(f.concurrency);
  if (!levels.ok()) return fail(2, levels.error().message);
  auto rate = parse_rate(f.request_rate);
  if (!rate.ok()) return fail(2, rate.error().message);
  if (f.endpoint != "completions" && f.endpoint != "chat") {
    MOAT_LOG(error, "--endpoint {}: expected completions or chat", f.endpoint);
    return 2;
  }
  if (f.num_prompts < 0 || f.prompts_per_stream < 0) {
    MOAT_LOG(error, "--num-prompts and --prompts-per-stream must be positive");
    return 2;
  }
  if (f.gpus < 0 || f.price < 0 || (f.gpus > 0) != (f.price > 0)) {
    MOAT_LOG(error, "--gpus and --price-per-gpu-hour go together and must be positive");
    return 2;
  }
  if (auto url = bench::parse_base_url(f.base_url); !url.ok())
    return fail(2, url.error().message);
  // httplib 0.11 writes with flags 0 (no MSG_NOSIGNAL): a request written onto a connection the
  // server has just reset must fail as a write error, which the client resends, not kill us.
  std::signal(SIGPIPE, SIG_IGN);

  bench::EndpointConfig endpoint;
  endpoint.base_url = f.base_url;
  endpoint.model = f.model;
  endpoint.api_key = f.api_key;
  if (endpoint.api_key.empty())
    if (const char* k = std::getenv("OPENAI_API_KEY")) endpoint.api_key = k;
  endpoint.chat = f.endpoint == "chat";
  endpoint.ignore_eos = f.ignore_eos;
  endpoint.timeout_s = f.timeout_s;
  if (endpoint.model.empty()) {
    auto id = bench::fetch_model_id(endpoint);
    if (id.ok()) {
      endpoint.model = *id;
      MOAT_LOG(info, "model: {} (from /v1/models)", endpoint.model);
    } else {
      MOAT_LOG(warn, "no --model and {}; sending requests without a model name", id.error().message);
    }
  }

  bench::WorkloadSpec spec;
  spec.input_len = f.input_len;
  spec.output_len = f.output_len;
  spec.range_ratio = f.range_ratio;
  spec.dataset_path = f.dataset;
  spec.tokenizer_dir = f.tokenizer;

  bench::RunContext ctx;
  ctx.base_url = f.base_url;
  ctx.model = endpoint.model;
  ctx.endpoint = f.endpoint;
  ctx.input_len = f.input_len;
  ctx.output_len = f.output_len;
  ctx.range_ratio = f.range_ratio;
  ctx.exact_input_tokens = !f.tokenizer.empty();

  // Word prompts are one token per word only on GPT-2/Llama-style vocabularies; the server's own
  // count sizes them for its tokenizer.
  if (f.tokenizer.empty() && f.dataset.empty()) {
    if (!f.calibrate) {
      MOAT_LOG(info, "prompt lengths not calibrated (--no-calibrate): one common English word per "
                     "token, which holds for GPT-2/Llama-style vocabularies only");
    } else if (auto c = bench::calibrate_word_prompts(endpoint, f.seed); c.ok()) {
      spec.tokens_per_word = c->tokens_per_word;
      ctx.server_tokens_per_word = c->tokens_per_word;
      MOAT_LOG(info, "{}", bench::describe(*c, f.input_len));
    } else {
      MOAT_LOG(warn, "prompt lengths not calibrated: {}; prompts have one common English word per "
                     "token, which holds for GPT-2/Llama-style vocabularies only (--tokenizer makes "
                     "them exact)",
               c.error().message);
    }
  }

  std::signal(SIGINT, on_sigint);
  bench::CostInputs cost{f.gpus, f.price};
  std::vector<bench::Metrics> sweep;
  int offset = 0;
  for (size_t level = 0; level < levels->size() && !g_interrupted.load(); ++level) {
    int c = (*levels)[level];
    // Enough requests per level for a steady state well past the ramp-up of the first wave.
    int n = f.num_prompts > 0          ? f.num_prompts
            : f.prompts_per_stream > 0 ? f.prompts_per_stream * (c > 0 ? c : 16)
                                       : std::max(16, 4 * (c > 0 ? c : 16));
    // Fresh prompts for every level and for the warmup, so no level rides on a prefix cache
    // that an earlier one filled.
    uint64_t seed = f.seed + 1000003ull * level;
    // By default one warmup request per worker, so that every connection is open before the
    // clock starts: a burst of connects overflows small listen backlogs (Python's and
    // cpp-httplib's are 5) and the SYN retries would show up as 1-3 s TTFTs or failures.
    int workers = c > 0 ? std::min(c, n) : n;
    int num_warmup = f.warmup >= 0 ? f.warmup : workers;
    auto all = bench::build_workload(spec, n + num_warmup, seed, offset);
    if (!all.ok()) return fail(2, all.error().message);
    offset += n + num_warmup;
    std::vector<bench::BenchRequest> requests(all->begin(), all->begin() + n);
    std::vector<bench::BenchRequest> warmup(all->begin() + n, all->end());
    // Warmup is for connections and server caches, not for timing: keep it short.
    for (auto& w : warmup) w.output_tokens = std::min<int64_t>(w.output_tokens, 16);

    bench::RunOptions options;
    options.concurrency = c;
    options.request_rate = *rate;
    options.seed = f.seed;
    options.progress = !f.no_progress && isatty(STDERR_FILENO);
    options.label = c > 0 ? fmt::format("c={}", c) : "c=inf";
    options.interrupt = &g_interrupted;
    auto result = bench::run_benchmark(endpoint, requests, warmup, options);
    if (!result.ok()) {
      MOAT_LOG(error, "{}", result.error().message);
      return 1;
    }
    if (result->records.empty()) break;  // interrupted before anything was sent
    bench::Metrics m = bench::compute_metrics(result->records, result->duration_s, c, *rate, cost);
    m.interrupted = result->interrupted;
    ctx.num_prompts = n;
    bench::print_summary(stdout, m, ctx);
    std::fflush(stdout);
    sweep.push_back(std::move(m));
  }
  std::signal(SIGINT, SIG_DFL);
  if (sweep.empty()) {
    MOAT_LOG(error, "interrupted before any request finished; nothing to report");
    return 130;
  }
  std::printf("\n");
  bench::print_sweep_table(stdout, sweep);
  if (!f.json_path.empty())
    if (auto s = bench::write_json(f.json_path, sweep, ctx); !s.ok())
      return fail(1, s.error().message);
  if (!f.csv_path.empty())
    if (auto s = bench::write_csv(f.csv_path, sweep, ctx); !s.ok())
      return fail(1, s.error().message);
  if (!f.plot_path.empty()) {
    std::string title = fmt::format("{}  in {} / out {}", endpoint.model.empty() ? f.base_url : endpoint.model,
                                    f.input_len, f.output_len);
    if (auto s = bench::plot_throughput_curve(f.plot_path, sweep, std::max(1, f.gpus), title); !s.ok())
      return fail(1, s.error().message);
  }
  if (g_interrupted.load()) return 130;
  return 0;
}

void setup(CLI::App& sub, int& exit_code) {
  auto f = std::make_shared<BenchFlags>();
  sub.add_option("--base-url", f->base_url, "Server URL, e.g. http://127.0.0.1:8000")->required();
  sub.add_option("--model", f->model, "Model name to send (default: the first of GET /v1/models)");
  sub.add_option("--api-key", f->api_key, "Bearer token (default: $OPENAI_API_KEY)");
  sub.add_option("--endpoint", f->endpoint, "completions (/v1/completions) or chat (/v1/chat/completions)")
      ->capture_default_str();
  sub.add_option("--num-prompts", f->num_prompts,
                 "Measured requests per concurrency level (default: max(16, 4 x concurrency))");
  sub.add_option("--prompts-per-stream", f->prompts_per_stream,
                 "Measured requests per level as a multiple of its concurrency (instead of --num-prompts)")
      ->excludes(sub.get_option("--num-prompts"));
  sub.add_option("--input-len", f->input_len, "Prompt tokens (the maximum with --range-ratio < 1)")
      ->capture_default_str();
  sub.add_option("--output-len", f->output_len, "max_tokens per request")->capture_default_str();
  sub.add_option("--range-ratio", f->range_ratio,
                 "Lengths uniform in [len x ratio, len], as sglang bench_serving; 1 = fixed")
      ->capture_default_str();
  sub.add_option("--dataset", f->dataset, "JSONL prompts ({\"prompt\": ..., \"output_len\": N} per line)");
  sub.add_option("--tokenizer,--model-dir", f->tokenizer,
                 "Local model dir whose tokenizer makes prompt lengths exact");
  sub.add_option("--concurrency", f->concurrency, "Concurrency sweep, e.g. 1,4,16,64 (inf = unlimited)")
      ->capture_default_str();
  sub.add_option("--request-rate", f->request_rate, "Poisson arrivals in requests/s, or inf")
      ->capture_default_str();
  sub.add_option("--warmup", f->warmup,
                 "Unmeasured warmup requests per level, at most 16 output tokens each "
                 "(default: one per concurrent stream, which opens every connection)");
  sub.add_option("--seed", f->seed, "Seed for prompts, lengths and arrivals")->capture_default_str();
  sub.add_option("--json", f->json_path, "Write one JSON record per concurrency (for moat plan --measured)");
  sub.add_option("--csv", f->csv_path, "Write the same records as CSV");
  sub.add_option("--plot", f->plot_path, "Throughput-vs-interactivity curve (.png or .svg)");
  sub.add_flag("--ignore-eos,!--no-ignore-eos", f->ignore_eos,
               "Send ignore_eos so every request generates --output-len tokens (default on)");
  sub.add_option("--gpus", f->gpus, "GPUs behind the server, for per-GPU and cost figures");
  sub.add_option("--price-per-gpu-hour", f->price, "USD per GPU-hour, for tok/s per dollar and $/Mtok");
  sub.add_option("--timeout", f->timeout_s, "Seconds to wait for data on a stream")->capture_default_str();
  sub.add_flag("--no-progress", f->no_progress, "No progress bar on stderr");
  sub.add_flag("--calibrate,!--no-calibrate", f->calibrate,
               "Without --tokenizer, size word prompts by the server's token count (POST /tokenize, "
               "else usage.prompt_tokens of two one-token requests) (default on)");
  sub.callback([f, &exit_code] { exit_code = run(*f); });
}

CommandRegistrar reg("bench", "Benchmark an OpenAI-compatible server: TTFT, TPOT, ITL, tok/s, cost",
                     setup);

}  // namespace
}  // namespace moat::cli
