// Offline serving throughput: requests through the engine core (no HTTP), closed loop at each
// concurrency (a finished request is replaced at once, so prompts keep arriving while others
// decode), on one checkpoint at one thread count. Per concurrency: output tok/s, per-stream tok/s,
// TTFT and ITL p50 / p99, next to the decode-step roofline measured in the same process:
//   a decode step of B streams reads every weight outside the routed experts once, plus the
//   experts B tokens touch (E * (1 - (1 - k/E)^B) per MoE layer under uniform routing), plus each
//   stream's latent cache; it does B tokens' FLOPs (2 x active params + attention). Its time is
//   the larger of bytes / bandwidth and FLOPs / the matmul peak (bench/matmul_peak.h: AMX,
//   vdpbf16ps or fp32 FMAs, whichever the matmuls run on); the roofline is B / that time.
//
//   engine_bench --model DIR [--threads N] [--concurrency 1,4,16,64] [--prompt-tokens 128]
//                [--output-tokens 64] [--requests-per-stream 2] [--max-num-batched-tokens N] [--markdown]
//                [--profile]
// --profile: after the rows, each concurrency's decode-only step split by kind of op (ops::OpProfile),
// the matmuls' and routed experts' weight bytes as GB/s against the bandwidth probe.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <sstream>
#include <string>

#include "base/thread_pool.h"
#include "bench/metrics.h"
#include "engine/engine.h"
#include "matmul_peak.h"
#include "op_profile.h"
#include "roofline.h"

namespace {

using namespace moat;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model;
  int threads = 1;
  std::vector<int> concurrency = {1, 4, 16, 64};
  int64_t prompt_tokens = 128, output_tokens = 64;
  int requests_per_stream = 2;
  int64_t max_num_batched_tokens = 0;  // 0: the engine's default
  bool no_prefix_caching = false;       // hybrids: no state snapshots, so prompts are not cut at a block boundary
  bool markdown = false;
  bool profile = false;  // after each level's row: its decode-only steps' time by kind of op
};

struct Level {
  int concurrency = 0;
  int64_t requests = 0, output_tokens = 0;
  double seconds = 0, output_tps = 0, per_stream_tps = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0, itl_p50_ms = 0, itl_p99_ms = 0;
  double roofline_tps = 0;
  // Steps that only decode, with every stream running: their mean time against the roofline
  // step time (B / roofline_tps), so prefill sharing the time does not hide decode efficiency.
  double decode_step_ms = 0;
  int64_t decode_steps = 0;
  const char* bound = "";
  ops::OpProfile decode_profile;  // --profile: the decode-only steps' ops, summed
};

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Level run_level(DeepseekModel& model, int concurrency, const Args& a, double bandwidth, double matmul_peak) {
  EngineConfig cfg;
  cfg.max_model_len = a.prompt_tokens + a.output_tokens;
  cfg.max_num_seqs = concurrency;
  if (a.max_num_batched_tokens > 0) cfg.max_num_batched_tokens = a.max_num_batched_tokens;
  cfg.enable_prefix_caching = !a.no_prefix_caching;
  cfg.kv_memory_bytes = model.cache_shape().bytes_per_token() * cfg.max_model_len * concurrency * 5 / 4 + (64 << 20);
  auto engine = Engine::create(model, cfg);
  if (!engine) {
    std::fprintf(stderr, "engine_bench: %s\n", engine.error().message.c_str());
    std::exit(1);
  }
  std::mt19937 rng(1234 + concurrency);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(model.config().vocab_size - 1));
  auto make = [&] {
    GenerateRequest r;
    r.prompt.resize(static_cast<size_t>(a.prompt_tokens));
    for (auto& t : r.prompt) t = token(rng);  // random prompts: no prefix-cache hits
    r.sampling.temperature = 0.0f;
    r.stop.max_tokens = a.output_tokens;
    r.stop.ignore_eos = true;
    return r;
  };
  const int64_t total = static_cast<int64_t>(concurrency) * a.requests_per_stream;
  Level L;
  std::map<uint64_t, Clock::time_point> sent, last_token;
  std::vector<double> ttft, itl;
  int64_t submitted = 0, finished = 0, tokens = 0;
  auto submit = [&] {
    auto id = (*engine)->add_request(make());
    if (!id) {
      std::fprintf(stderr, "engine_bench: %s\n", id.error().message.c_str());
      std::exit(1);
    }
    sent[*id] = Clock::now();
    ++submitted;
  };
  const auto start = Clock::now();
  for (int i = 0; i < concurrency; ++i) submit();
  double decode_ms_sum = 0;
  ops::OpProfile step_profile;
  while ((*engine)->has_work()) {
    const int64_t prompt_before = (*engine)->stats().prompt_tokens_computed;
    step_profile = {};
    if (a.profile) model.set_op_profile(&step_profile);
    const auto step_start = Clock::now();
    auto outs = (*engine)->step();
    const auto now = Clock::now();
    model.set_op_profile(nullptr);
    if ((*engine)->stats().prompt_tokens_computed == prompt_before && static_cast<int>(outs.size()) == concurrency) {
      decode_ms_sum += ms(now - step_start);
      ++L.decode_steps;
      for (int k = 0; k < ops::OpProfile::kNumKinds; ++k) {
        L.decode_profile.buckets[k].seconds += step_profile.buckets[k].seconds;
        L.decode_profile.buckets[k].weight_bytes += step_profile.buckets[k].weight_bytes;
        L.decode_profile.buckets[k].calls += step_profile.buckets[k].calls;
      }
    }
    for (const RequestOutput& o : outs) {
      if (o.new_tokens.empty()) continue;
      tokens += static_cast<int64_t>(o.new_tokens.size());
      auto prev = last_token.find(o.id);
      if (prev == last_token.end()) ttft.push_back(ms(now - sent[o.id]));
      else itl.push_back(ms(now - prev->second));
      last_token[o.id] = now;
      if (o.finished) {
        ++finished;
        if (submitted < total) submit();
      }
    }
  }
  L.concurrency = concurrency;
  L.requests = finished;
  L.output_tokens = tokens;
  L.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  L.output_tps = tokens / L.seconds;
  L.ttft_p50_ms = bench::percentile(ttft, 50);
  L.ttft_p99_ms = bench::percentile(ttft, 99);
  L.itl_p50_ms = bench::percentile(itl, 50);
  L.itl_p99_ms = bench::percentile(itl, 99);
  double itl_mean = 0;
  for (double v : itl) itl_mean += v;
  itl_mean /= std::max<size_t>(1, itl.size());
  L.per_stream_tps = itl_mean > 0 ? 1000.0 / itl_mean : 0;

  // Decode-step roofline at B = concurrency streams, each at the mean context of its decode.
  const double B = concurrency;
  const ModelConfig& c = model.config();
  const double ctx = a.prompt_tokens + a.output_tokens / 2.0;
  const double bytes = model.weight_bytes_per_step(concurrency) + B * ctx * model.cache_shape().bytes_per_token();
  const double attn_flops = c.num_hidden_layers * ctx * c.num_attention_heads * 2.0 * (c.kv_cache_dim() + c.kv_lora_rank);
  const double flops = B * (2.0 * model.active_weights_per_token().params + attn_flops);
  const double t_mem = bytes / bandwidth, t_flops = flops / matmul_peak;
  L.roofline_tps = B / std::max(t_mem, t_flops);
  L.bound = t_mem >= t_flops ? "memory" : "compute";
  L.decode_step_ms = L.decode_steps ? decode_ms_sum / L.decode_steps : 0;
  return L;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (s == "--model") a.model = next();
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--prompt-tokens") a.prompt_tokens = std::stoll(next());
    else if (s == "--output-tokens") a.output_tokens = std::stoll(next());
    else if (s == "--requests-per-stream") a.requests_per_stream = std::stoi(next());
    else if (s == "--max-num-batched-tokens") a.max_num_batched_tokens = std::stoll(next());
    else if (s == "--markdown") a.markdown = true;
    else if (s == "--profile") a.profile = true;
    else if (s == "--no-prefix-caching") a.no_prefix_caching = true;
    else if (s == "--concurrency") {
      a.concurrency.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) a.concurrency.push_back(std::stoi(item));
    } else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      return 2;
    }
  }
  if (a.model.empty()) {
    std::fprintf(stderr, "usage: engine_bench --model DIR [--threads N] [--concurrency 1,4,16,64] [--profile]\n");
    return 2;
  }
  auto loaded = DeepseekModel::load(a.model, {.backend = ops::Backend::cpu, .max_context = a.prompt_tokens + a.output_tokens,
                                              .threads = a.threads});
  if (!loaded) {
    std::fprintf(stderr, "engine_bench: %s\n", loaded.error().message.c_str());
    return 1;
  }
  DeepseekModel& model = **loaded;
  ScopedThreadPool pool_scope(model.thread_pool());  // the roofline probes run on the model's threads
  bench::HugeBuffer<float> bw_buf((512ll << 20) / 4);
  const double bandwidth = bench::read_bandwidth_gbs(bw_buf) * 1e9;
  const bench::MatmulPeak peak = bench::matmul_peak();
  const double matmul_peak = peak.gflops * 1e9;
  // One untimed request of the workload's prompt length first: faults the weights in and grows the
  // forward's buffers to a whole prompt, as moat bench's warm-up requests do for moat serve. (A
  // 16-token warm-up left the first 128-token prefill of the timed run to grow them: TTFT at
  // concurrency 1 read 787 ms here against the server's 454 ms on the same workload.)
  run_level(model, 1, Args{.prompt_tokens = a.prompt_tokens, .output_tokens = 4, .requests_per_stream = 1}, bandwidth,
            matmul_peak);

  std::vector<Level> levels;
  for (int c : a.concurrency) levels.push_back(run_level(model, c, a, bandwidth, matmul_peak));
  // decode-step efficiency: roofline step time over the measured pure-decode step time
  auto decode_pct = [](const Level& L) {
    return L.decode_step_ms > 0 ? 100.0 * (1000.0 * L.concurrency / L.roofline_tps) / L.decode_step_ms : 0.0;
  };
  const std::string label =
      (a.max_num_batched_tokens > 0 ? a.model + " (budget " + std::to_string(a.max_num_batched_tokens) + ")" : a.model) +
      (a.no_prefix_caching ? " (no prefix caching)" : "");
  if (a.markdown) {
    for (const Level& L : levels)
      std::printf("| %s | %d | %d | %ld | %.1f | %.2f | %.0f / %.0f | %.0f / %.0f | %.1f (%s) | %.0f%% | %.0f / %.0f | %.0f%% |\n",
                  label.c_str(), a.threads, L.concurrency, L.requests, L.output_tps, L.per_stream_tps, L.ttft_p50_ms,
                  L.ttft_p99_ms, L.itl_p50_ms, L.itl_p99_ms, L.roofline_tps, L.bound,
                  100.0 * L.output_tps / L.roofline_tps, L.decode_step_ms, 1000.0 * L.concurrency / L.roofline_tps,
                  decode_pct(L));
  } else {
    std::printf("%s, %d threads, prompt %ld + output %ld tokens; bandwidth %.1f GB/s, matmul peak %.0f GFLOPS (%s)\n",
                a.model.c_str(), a.threads, a.prompt_tokens, a.output_tokens, bandwidth / 1e9, matmul_peak / 1e9, peak.probe);
    std::printf("%11s %8s %10s %10s %17s %17s %22s %6s %22s %6s\n", "concurrency", "requests", "out tok/s", "tok/s/strm",
                "TTFT p50/p99 ms", "ITL p50/p99 ms", "step roofline tok/s", "%", "decode step / roof ms", "%");
    for (const Level& L : levels)
      std::printf("%11d %8ld %10.1f %10.2f %8.0f /%7.0f %8.0f /%7.0f %14.1f (%s) %5.0f%% %11.0f /%8.0f %5.0f%%\n",
                  L.concurrency, L.requests, L.output_tps, L.per_stream_tps, L.ttft_p50_ms, L.ttft_p99_ms, L.itl_p50_ms,
                  L.itl_p99_ms, L.roofline_tps, L.bound, 100.0 * L.output_tps / L.roofline_tps, L.decode_step_ms,
                  1000.0 * L.concurrency / L.roofline_tps, decode_pct(L));
  }
  if (a.profile) {
    // per decode-only step: where its time goes, and how fast the matmuls stream their weights
    for (const Level& L : levels) {
      if (L.decode_steps == 0) continue;
      const double steps = static_cast<double>(L.decode_steps);
      std::printf("concurrency %d: a decode-only step %.2f ms (%ld steps):\n", L.concurrency, L.decode_step_ms,
                  L.decode_steps);
      bench::print_op_profile(L.decode_profile, 1e-3 * L.decode_step_ms * steps, steps, bandwidth,
                              "norms, routing, residuals, embedding, sampling, scheduling");
    }
  }
  return 0;
}
