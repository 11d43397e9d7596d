// Model-level benchmark for one checkpoint at one thread count (one process per run, so peak RSS
// is this configuration's own): prefill of --prompt-tokens random tokens, then --decode-tokens
// greedy decode steps at one stream, each next to its roofline measured in the same process:
//   decode roofline  = bandwidth / bytes one decode token moves: the active weights (routed
//                      experts at their stored size: MXFP4 0.5 B per weight + an e8m0 scale per
//                      32), a hybrid model's recurrent state (state_bytes_per_request(), read and
//                      written once per token: the KDA layers' conv inputs and fp32 states), and
//                      the latent rows of the MLA layers (read at the context length, one written).
//                      The bandwidth is measured on the memory holding the weights (the files'
//                      mappings or copies and the realigned matrices: DeepseekModel::weight_memory,
//                      up to 8 GiB) when it is larger than the caches: on VMs
//                      that memory can read far slower than a freshly allocated buffer (both shown).
//                      Decode's is read around each timed repetition (one-pass probes before and
//                      after it), as the VM's bandwidth drifts from minute to minute
//   prefill roofline = the slower of the FLOPs per prompt at the matmul peak (AMX's where the bf16
//                      matmul resolves to it, else vdpbf16ps') and the weight bytes the prompt's
//                      forward reads (weight_bytes_per_step) at the bandwidth; FLOPs per prompt:
//                      2 x active params per token, the lm_head once per forward call; absorbed MLA attention over the MLA layers; the KDA
//                      recurrence's 7 K V flops per token and head over the KDA layers
// Prints one markdown table row (--markdown) or a readable summary; --decode-bytes makes the row
// the decode byte breakdown instead, --profile where a decode token's time goes: the timed steps
// run with an ops::OpProfile attached (wall time per kind of op; matmuls and routed experts with
// the weight bytes they streamed, as GB/s and % of the bandwidth measured below).
// --contexts N1,N2,...: instead, prefill of N random tokens from an empty cache at each N (in
// forward calls of --prefill-chunk tokens, as an engine's chunked prefill runs a long prompt),
// timed once each: tok/s and us/token, split into the KDA layers, the MLA layers and the rest by
// timestamps at each layer's output (a layer's time is its attention plus its MLP / MoE). A
// linear-attention layer's time per token is flat in N; an MLA layer's grows with N.
//
// --no-realign: the weights stay where the checkpoint has them, off cache lines or not
// (DeepseekModel::Options::realign_weights), to measure what realigning them gains.
//
// --repetitions N: the prefill and the decode run N times each (after the untimed ones): the rows
// give the median, the readable summary also the range (llama-bench -r N reports the same way).
//
//   model_bench --model DIR [--threads N] [--prompt-tokens 512] [--decode-tokens 32] [--repetitions 1] [--exact]
//               [--weights-in-memory] [--no-realign] [--markdown] [--decode-bytes]
//               [--contexts 1024,8192] [--prefill-chunk 2048]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "base/thread_pool.h"
#include "models/deepseek_v3.h"
#include "matmul_peak.h"
#include "op_profile.h"
#include "roofline.h"

namespace {

using namespace moat;

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

struct Args {
  std::string model;
  int threads = 1;
  int64_t prompt_tokens = 512;
  int64_t decode_tokens = 32;
  int64_t repetitions = 1;  // prefill and decode timed this many times each: the median, and the range
  bool exact = false;  // OpTable::set_exact_activations
  bool weights_in_memory = false;
  bool realign = true;  // DeepseekModel::Options::realign_weights (--no-realign: weights where the checkpoint has them)
  bool markdown = false;
  bool decode_bytes = false;     // the markdown row is the decode byte breakdown
  bool profile = false;          // the markdown row is the decode time by kind of op
  std::vector<int64_t> contexts;  // prefill sweep instead of prefill + decode
  int64_t prefill_chunk = 2048;   // tokens per forward call in the sweep
};

// "1024,8192,32k" -> {1024, 8192, 32768}; nullopt on anything else.
std::optional<std::vector<int64_t>> parse_counts(const std::string& list) {
  std::vector<int64_t> out;
  size_t p = 0;
  while (p <= list.size()) {
    const size_t q = std::min(list.find(',', p), list.size());
    std::string item = list.substr(p, q - p);
    int64_t scale = 1;
    if (!item.empty() && (item.back() == 'k' || item.back() == 'K')) scale = 1024, item.pop_back();
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      return std::nullopt;
    }
    if (used != item.size() || v <= 0) return std::nullopt;
    out.push_back(v * scale);
    p = q + 1;
  }
  return out;
}

// FLOPs of a prefill of n tokens from position 0 in calls of `chunk` tokens: 2 per active weight
// per token, the lm_head (vocab x hidden, counted in active.params) only for each call's last
// token; absorbed MLA attention per (query, key) pair and head over the MLA layers (q.row over D
// values, the latent output over kv_lora); KDA's 7 K V per token and head over the KDA layers
// (decay, S^T k, the rank-1 update, S^T q; kernel_bench's kda rows use the same count).

double prefill_flops(const ModelConfig& c, double active_params, int64_t n, int64_t chunk) {
  const double head = static_cast<double>(c.vocab_size) * c.hidden_size;
  const double calls = static_cast<double>((n + chunk - 1) / chunk);
  const double pairs = n * (n + 1) / 2.0;
  const double attn = c.num_mla_layers() * pairs * c.num_attention_heads * 2.0 * (c.kv_cache_dim() + c.kv_lora_rank);
  double kda = 0;
  if (c.linear_attn) {
    const double K = static_cast<double>(c.linear_attn->head_dim);
    kda = c.num_kda_layers() * static_cast<double>(n) * 7.0 * K * K * c.linear_attn->num_heads;
  }
  return 2.0 * (active_params - head) * n + 2.0 * head * calls + attn + kda;
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
    else if (s == "--decode-tokens") a.decode_tokens = std::stoll(next());
    else if (s == "--repetitions") a.repetitions = std::stoll(next());
    else if (s == "--exact") a.exact = true;
    else if (s == "--weights-in-memory") a.weights_in_memory = true;
    else if (s == "--no-realign") a.realign = false;
    else if (s == "--markdown") a.markdown = true;
    else if (s == "--decode-bytes") a.decode_bytes = true;
    else if (s == "--profile") a.profile = true;
    else if (s == "--contexts") {
      const std::string list = next();
      auto counts = parse_counts(list);
      if (!counts) {
        std::fprintf(stderr, "--contexts: expected a comma list of positive token counts such as 1024,8192,32k, got '%s'\n",
                     list.c_str());
        return 2;
      }
      a.contexts = *counts;
    } else if (s == "--prefill-chunk") a.prefill_chunk = std::stoll(next());
    else {
      std::fprintf(stderr, "usage: model_bench --model DIR [--threads N] [--prompt-tokens N] [--decode-tokens N] [--repetitions N] [--exact] [--weights-in-memory] [--no-realign] [--markdown] [--decode-bytes] [--profile] [--contexts N1,N2,...] [--prefill-chunk N]\n");
      return 2;
    }
  }
  if (a.prefill_chunk <= 0) {
    std::fprintf(stderr, "--prefill-chunk: expected a positive token count\n");
    return 2;
  }
  if (a.repetitions <= 0 || a.decode_tokens <= 0) {
    std::fprintf(stderr, "--repetitions and --decode-tokens: expected positive counts\n");
    return 2;
  }
  constexpr int64_t kWarmupDecodeSteps = 4;
  const int64_t sweep_max = a.contexts.empty() ? 0 : *std::max_element(a.contexts.begin(), a.contexts.end());
  const int64_t context = a.contexts.empty() ? a.prompt_tokens + kWarmupDecodeSteps + a.decode_tokens : sweep_max;
  auto loaded = DeepseekModel::load(a.model, {.backend = ops::Backend::cpu, .max_context = context,
                                              .exact_activations = a.exact,
                                              .weights = a.weights_in_memory ? WeightPlacement::memory
                                                                             : WeightPlacement::mmap,
                                              .threads = a.threads,
                                              .realign_weights = a.realign});
  if (!loaded) {
    std::fprintf(stderr, "model_bench: %s\n", loaded.error().message.c_str());
    return 1;
  }
  DeepseekModel& model = **loaded;
  ScopedThreadPool pool_scope(model.thread_pool());  // the roofline probes run on the model's threads
  const ModelConfig& c = model.config();
  const int64_t V = c.vocab_size;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(a.prompt_tokens));
  for (auto& t : prompt) t = token(rng);
  std::vector<float> logits(static_cast<size_t>(V));
  auto cache = model.new_sequence_cache(context);
  // Before each prompt from position 0: a fresh state slot (a new request's state is zeros); the
  // latent rows are simply overwritten.
  auto reset_state = [&] {
    if (!cache.states.enabled()) return;
    cache.states.release(cache.state_slot);
    cache.state_slot = *cache.states.allocate();
  };

  if (!a.contexts.empty()) {
    // Prefill sweep; per-layer time from the layer-output hook.
    std::vector<int32_t> tokens(static_cast<size_t>(sweep_max));
    for (auto& t : tokens) t = token(rng);
    std::vector<double> layer_s(static_cast<size_t>(model.num_layers()));
    auto t_prev = std::chrono::steady_clock::now();
    const DeepseekModel::LayerHook hook = [&](int64_t layer, const float*, int64_t) {
      const auto now = std::chrono::steady_clock::now();
      layer_s[static_cast<size_t>(layer)] += std::chrono::duration<double>(now - t_prev).count();
      t_prev = now;
    };
    auto run_prompt = [&](int64_t n) {
      reset_state();
      std::fill(layer_s.begin(), layer_s.end(), 0.0);
      for (int64_t off = 0; off < n; off += a.prefill_chunk) {
        const int64_t len = std::min(a.prefill_chunk, n - off);
        t_prev = std::chrono::steady_clock::now();
        model.forward(cache, std::span<const int32_t>(tokens.data() + off, static_cast<size_t>(len)),
                      static_cast<int32_t>(off), logits.data(), ForwardBatch::Logits::last, hook);
      }
    };
    // Untimed: faults the weights in and sizes the workspace for a full chunk.
    run_prompt(std::min(a.prefill_chunk, sweep_max));
    struct Point {
      int64_t n;
      double total_s, kda_s, mla_s, rest_s;
    };
    std::vector<Point> points;
    for (int64_t n : a.contexts) {
      const auto t0 = std::chrono::steady_clock::now();
      run_prompt(n);
      Point pt{n, bench::seconds_since(t0), 0, 0, 0};
      for (int64_t i = 0; i < model.num_layers(); ++i)
        (c.is_kda_layer(i) ? pt.kda_s : pt.mla_s) += layer_s[static_cast<size_t>(i)];
      // the rest: final norm and lm_head after the last layer (the embedding gather counts in layer 0)
      pt.rest_s = pt.total_s - pt.kda_s - pt.mla_s;
      points.push_back(pt);
    }
    const bench::MatmulPeak peak = bench::matmul_peak();
    const double bf16_peak = peak.gflops * 1e9;
    const auto active = model.active_weights_per_token();
    if (!a.markdown)
      std::printf("model %s, %d thread(s), %s activations, prefill in calls of %lld tokens; matmul peak %.1f GFLOPS (%s)\n"
                  "  %lld KDA + %lld MLA layers (each layer's time: its attention and its MLP / MoE)\n",
                  a.model.c_str(), a.threads, a.exact ? "exact" : "default", static_cast<long long>(a.prefill_chunk),
                  bf16_peak / 1e9, peak.probe, static_cast<long long>(c.num_kda_layers()), static_cast<long long>(c.num_mla_layers()));
    for (const Point& pt : points) {
      const double n = static_cast<double>(pt.n), us = 1e6 / n;
      const double roof_tps = n / (prefill_flops(c, static_cast<double>(active.params), pt.n, a.prefill_chunk) / bf16_peak);
      const double tps = n / pt.total_s;
      if (a.markdown) {
        std::printf("| %s | %d | %lld (calls of %lld) | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f%% |\n",
                    a.model.c_str(), a.threads, static_cast<long long>(pt.n),
                    static_cast<long long>(std::min(pt.n, a.prefill_chunk)), tps, pt.total_s * us, pt.kda_s * us,
                    pt.mla_s * us, pt.rest_s * us, roof_tps, 100 * tps / roof_tps);
      } else {
        std::printf("  prefill %6lld tokens: %8.1f tok/s, %8.1f us/token (KDA layers %.1f, MLA layers %.1f, rest %.1f); "
                    "roofline %.1f tok/s (%.0f%%)\n",
                    static_cast<long long>(pt.n), tps, pt.total_s * us, pt.kda_s * us, pt.mla_s * us, pt.rest_s * us,
                    roof_tps, 100 * tps / roof_tps);
      }
    }
    return 0;
  }

  auto prefill = [&] {
    reset_state();
    model.forward(cache, prompt, 0, logits.data());
  };
  // The first prefill faults the mmapped weights in; the next --repetitions are the measurement.
  prefill();
  ops::OpProfile prefill_profile;
  if (a.profile) model.set_op_profile(&prefill_profile);
  std::vector<double> prefill_runs_s;
  for (int64_t r = 0; r < a.repetitions; ++r) {
    const auto p0 = std::chrono::steady_clock::now();
    prefill();
    prefill_runs_s.push_back(bench::seconds_since(p0));
  }
  model.set_op_profile(nullptr);

  // Greedy picks through the op table's argmax, as the engine's sampler does: std::max_element
  // over the 102,400 logits took ~0.37 ms a token on Zen 5 (a compare chain, one element at a
  // time), 1.7% of a 2-thread decode step that no engine spends.
  auto greedy = [&] {
    int32_t id = 0;
    model.ops().argmax(logits.data(), 1, V, &id);
    return id;
  };
  const int32_t first_token = greedy();
  int32_t next_token = first_token;
  int64_t position = a.prompt_tokens;
  auto decode_step = [&] {
    model.forward(cache, std::span<const int32_t>(&next_token, 1), static_cast<int32_t>(position++), logits.data());
    next_token = greedy();
  };
  // A few untimed steps first: the steady state is what a long generation sees (right after a
  // large prefill the kernel may still be settling huge pages and caches).
  for (int64_t n = 0; n < kWarmupDecodeSteps; ++n) decode_step();
  ops::OpProfile profile;
  if (a.profile) model.set_op_profile(&profile);
  // Each repetition decodes the same positions again after the prompt and warm-up (their latent
  // rows are overwritten; a hybrid model's recurrent state runs on, which costs the same), as
  // llama-bench's tg repetitions each start over.
  // The memory the weights are read from (DeepseekModel::weight_memory: the checkpoint's mapping or
  // copy, and the realigned copies; up to 8 GiB), when it is larger than the caches: on VMs it can
  // read far slower than a freshly allocated buffer (both shown). Each range starts on a cache line,
  // as the weights do, and leaves out pieces under 1 MiB.
  bench::Regions weight_regions;
  if (model.checkpoint().total_bytes() >= (512ull << 20)) {
    size_t budget = 8ull << 30;
    for (const auto& [p, n] : model.weight_memory()) {
      const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63};
      const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
      if (end < begin + (1u << 20)) continue;
      const size_t bytes = std::min<size_t>(end - begin, budget);
      budget -= bytes;
      weight_regions.emplace_back(reinterpret_cast<const float*>(begin), static_cast<int64_t>(bytes / sizeof(float)));
    }
  }
  // Decode streams those weights, so its limit is their read speed in the same minute: a one-pass
  // probe before each repetition and after the last (bench::read_bandwidth_one_pass), each
  // repetition set against the mean of the two around it. (A model that fits in the caches has no
  // DRAM limit to track, and a probe would evict it.)
  std::vector<double> decode_runs_s;  // seconds per repetition of decode_tokens steps
  std::vector<double> probe_gbs;      // [repetitions + 1] around them; empty without weight_regions
  auto probe = [&] {
    if (!weight_regions.empty()) probe_gbs.push_back(bench::read_bandwidth_one_pass(weight_regions).gbs);
  };
  ThreadPool::Stats decode_pool;  // the timed steps' share of the pool's counts (not the probes')
  for (int64_t r = 0; r < a.repetitions; ++r) {
    position = a.prompt_tokens + kWarmupDecodeSteps;
    next_token = first_token;
    probe();
    const ThreadPool::Stats before = model.thread_pool().stats();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t n = 0; n < a.decode_tokens; ++n) decode_step();
    decode_runs_s.push_back(bench::seconds_since(t0));
    const ThreadPool::Stats after = model.thread_pool().stats();
    decode_pool.jobs += after.jobs - before.jobs;
    decode_pool.caller_wait_seconds += after.caller_wait_seconds - before.caller_wait_seconds;
  }
  probe();
  model.set_op_profile(nullptr);
  // median (the upper one of an even count: the slower) and the range, as llama-bench reports
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double prefill_s = median(prefill_runs_s), decode_s = median(decode_runs_s) / static_cast<double>(a.decode_tokens);
  const auto [prefill_fast, prefill_slow] = std::minmax_element(prefill_runs_s.begin(), prefill_runs_s.end());
  const auto [decode_fast, decode_slow] = std::minmax_element(decode_runs_s.begin(), decode_runs_s.end());
  // The profiles cover every repetition: their shares are of the runs' total time.
  const double decoded = static_cast<double>(a.decode_tokens * a.repetitions);
  double prefill_total_s = 0, decode_total_s = 0;
  for (double t : prefill_runs_s) prefill_total_s += t;
  for (double t : decode_runs_s) decode_total_s += t;
  const double rss = peak_rss_mib();
  const auto pages = model.weight_page_stats();
  const double huge_pct = 100.0 * static_cast<double>(pages.huge) / static_cast<double>(std::max<size_t>(1, pages.resident));

  // Rooflines from this process's own measurement of the machine.
  bench::HugeBuffer<float> bw_buf((512ll << 20) / 4);
  const double fresh_bandwidth = bench::read_bandwidth_gbs(bw_buf) * 1e9;
  // best of 3 rounds of each pattern: the prefill roofline's bandwidth and the decode's where no
  // probes ran around the repetitions
  const double bandwidth = weight_regions.empty() ? fresh_bandwidth : bench::read_bandwidth_gbs(weight_regions) * 1e9;
  const bench::MatmulPeak peak = bench::matmul_peak();
  const double bf16_peak = peak.gflops * 1e9;

  // Bytes one decode token moves: active weights, the recurrent state read and written, the MLA
  // layers' latent rows read at the mean context of the timed steps plus the row written.
  const auto active = model.active_weights_per_token();
  const double avg_ctx = a.prompt_tokens + kWarmupDecodeSteps + a.decode_tokens / 2.0;
  const double row_bytes = static_cast<double>(model.cache_shape().bytes_per_token());  // all MLA layers
  const double kv_read = (avg_ctx + 1) * row_bytes;
  const double state_rw = 2.0 * static_cast<double>(model.state_bytes_per_request());
  const double decode_bytes = static_cast<double>(active.bytes) + state_rw + kv_read;
  // The decode limit: with probes around the repetitions, each repetition is set against the mean
  // of the two either side of it; the % shown is the median of those shares, the roofline the
  // median of those bandwidths. Without them, the one probe above.
  double decode_bandwidth = bandwidth;
  std::vector<double> rep_pct;  // [repetitions] % of the bandwidth around each
  if (!probe_gbs.empty()) {
    std::vector<double> around;
    for (size_t r = 0; r < decode_runs_s.size(); ++r) {
      around.push_back(0.5e9 * (probe_gbs[r] + probe_gbs[r + 1]));
      rep_pct.push_back(100 * static_cast<double>(a.decode_tokens) * decode_bytes / decode_runs_s[r] / around.back());
    }
    decode_bandwidth = median(around);
  } else {
    rep_pct.push_back(100 * decode_bytes / decode_s / bandwidth);
  }
  std::sort(rep_pct.begin(), rep_pct.end());
  const double decode_pct = rep_pct[(rep_pct.size() - 1) / 2];  // the lower middle of an even count
  const double decode_roof_tps = decode_bandwidth / decode_bytes;
  const double prompt_flops = prefill_flops(c, static_cast<double>(active.params), a.prompt_tokens, a.prompt_tokens);
  // A prompt's forward reads the weights once (a MoE's routed experts: those its tokens touch), so
  // its time is at least the larger of its FLOPs at the matmul peak and those bytes at the
  // bandwidth: with AMX on a 2-core VM the bytes are the bound.
  const double prompt_bytes = model.weight_bytes_per_step(a.prompt_tokens);
  const double prompt_compute_s = prompt_flops / bf16_peak, prompt_memory_s = prompt_bytes / bandwidth;
  const double prefill_roof_tps = a.prompt_tokens / std::max(prompt_compute_s, prompt_memory_s);
  const char* prefill_bound = prompt_memory_s > prompt_compute_s ? "weight bytes" : "FLOPs";
  const double prefill_tps = a.prompt_tokens / prefill_s, decode_tps = 1.0 / decode_s;
  const double ckpt_mib = model.checkpoint().total_bytes() / 1048576.0, kv_mib = cache.pages.bytes() / 1048576.0;

  // per decode token: ms, and for kinds that stream weights GB/s and % of the bandwidth
  auto kind_ms = [&](ops::OpProfile::Kind k) { return 1e3 * profile.buckets[k].seconds / decoded; };
  auto kind_gbs = [&](ops::OpProfile::Kind k) {
    const auto& b = profile.buckets[k];
    return b.seconds > 0 ? b.weight_bytes / b.seconds / 1e9 : 0.0;
  };
  auto kind_share = [&](ops::OpProfile::Kind k) { return 100 * kind_gbs(k) * 1e9 / decode_bandwidth; };
  const double rest_ms = 1e3 * (decode_total_s - profile.seconds()) / decoded;
  if (a.markdown && a.profile) {
    // | model | threads | decode tok/s | ms / token | matmul ms (GB/s, % of bandwidth) | routed experts ms (GB/s,
    // %) | per-head matmul ms | MLA attention ms | KDA ms | rest ms |
    auto streamed = [&](ops::OpProfile::Kind k) {
      return fmt::format("{:.2f} ({:.1f}, {:.0f}%)", kind_ms(k), kind_gbs(k), kind_share(k));
    };
    std::printf("| %s | %d | %.2f | %.2f | %s | %s | %.2f | %.2f | %.2f | %.2f |\n", a.model.c_str(), a.threads, decode_tps,
                1e3 * decode_s, streamed(ops::OpProfile::matmul).c_str(),
                streamed(ops::OpProfile::routed_experts).c_str(), kind_ms(ops::OpProfile::head_matmul),
                kind_ms(ops::OpProfile::attention), kind_ms(ops::OpProfile::kda), rest_ms);
  } else if (a.markdown && a.decode_bytes) {
    // | model | threads | activations, weights | state B / request | context | weights MB | state read +
    // written MB | latent rows MB | MB / token | GB/s weights' memory / fresh | decode tok/s | roofline | % |
    std::printf("| %s | %d | %s, %s | %lld | %.0f | %.2f | %.2f | %.3f | %.2f | %.1f / %.1f | %.2f | %.2f | %.0f%% |\n",
                a.model.c_str(), a.threads, a.exact ? "exact" : "default", a.weights_in_memory ? "in memory" : "mmap",
                static_cast<long long>(model.state_bytes_per_request()), avg_ctx, active.bytes / 1e6, state_rw / 1e6, kv_read / 1e6, decode_bytes / 1e6, bandwidth / 1e9,
                fresh_bandwidth / 1e9, decode_tps, decode_roof_tps, decode_pct);
  } else if (a.markdown) {
    // a row run with kernels taken away (bench/run.sh: as an AVX-512F server without BF16 runs) says so
    const char* disabled = std::getenv("MOAT_DISABLE_ISA");
    const std::string model_cell =
        disabled && *disabled ? fmt::format("{} (MOAT_DISABLE_ISA={})", a.model, disabled) : a.model;
    std::printf("| %s | %d | %s, %s, %.0f%% | %.1f / %.1f | %.1f | %.1f | %.0f%% | %.2f | %.2f | %.0f%% | %.0f | %.0f + %.0f | %.2f |\n",
                model_cell.c_str(), a.threads, a.exact ? "exact" : "default",
                a.weights_in_memory ? "in memory" : "mmap", huge_pct, bandwidth / 1e9, fresh_bandwidth / 1e9,
                prefill_tps, prefill_roof_tps,
                100 * prefill_tps / prefill_roof_tps, decode_tps, decode_roof_tps, decode_pct,
                rss, ckpt_mib, kv_mib, rss / (ckpt_mib + kv_mib));
  } else {
    std::printf("model %s, %d thread(s), %s activations\n", a.model.c_str(), a.threads, a.exact ? "exact" : "default");
    std::printf("  resident weights in 2 MiB pages: %.0f%%; %.0f MiB of them copied onto cache lines at load\n", huge_pct,
                static_cast<double>(model.realigned_weight_bytes()) / (1 << 20));
    std::printf("  measured: bandwidth %.1f GB/s reading the weights' memory (%.1f GB/s a fresh buffer), matmul peak %.1f GFLOPS (%s)\n",
                bandwidth / 1e9, fresh_bandwidth / 1e9, bf16_peak / 1e9, peak.probe);
    std::printf("  bytes per decode token: %.2f MB of weights (%.1fM params) + %.2f MB of state read and written "
                "(%.2f MB per request) + %.3f MB of latent rows at ctx %.0f = %.2f MB\n",
                active.bytes / 1e6, active.params / 1e6, state_rw / 1e6, model.state_bytes_per_request() / 1e6,
                kv_read / 1e6, avg_ctx, decode_bytes / 1e6);
    std::printf("  prefill %lld tokens: %.1f tok/s, roofline %.1f tok/s (%.0f%%; bound by %s): %.1f GFLOP and %.2f GB of "
                "weights per prompt\n",
                static_cast<long long>(a.prompt_tokens), prefill_tps, prefill_roof_tps,
                100 * prefill_tps / prefill_roof_tps, prefill_bound, prompt_flops / 1e9, prompt_bytes / 1e9);
    std::printf("  decode: %.2f tok/s, roofline %.2f tok/s (%.0f%%): %.1f GB/s moved\n", decode_tps, decode_roof_tps,
                decode_pct, decode_tps * decode_bytes / 1e9);
    if (!probe_gbs.empty()) {
      const auto [slow, fast] = std::minmax_element(probe_gbs.begin(), probe_gbs.end());
      const auto [low, high] = std::minmax_element(rep_pct.begin(), rep_pct.end());
      std::printf("  decode's limit: the weights' memory read %.1f-%.1f GB/s in one-pass probes around the repetitions; "
                  "each repetition read %.0f-%.0f%% of the mean of the two either side of it\n",
                  *slow, *fast, *low, *high);
    }
    if (a.repetitions > 1)
      std::printf("  median of %lld repetitions: prefill %.1f-%.1f tok/s, decode %.1f-%.1f tok/s\n",
                  static_cast<long long>(a.repetitions), a.prompt_tokens / *prefill_slow, a.prompt_tokens / *prefill_fast,
                  a.decode_tokens / *decode_slow, a.decode_tokens / *decode_fast);
    std::printf("  peak RSS %.0f MiB; checkpoint %.0f MiB + KV %.0f MiB (ratio %.2f)\n", rss, ckpt_mib, kv_mib,
                rss / (ckpt_mib + kv_mib));
    if (a.profile) {
      // per decode token, and the whole timed prefill: where the time goes and how fast each kind
      // streams its weights
      auto print_profile = [&](const ops::OpProfile& prof, double total_s, double per, double bw) {
        bench::print_op_profile(prof, total_s, per, bw, "norms, routing, residuals, embedding, argmax");
      };
      const double reps = static_cast<double>(a.repetitions);
      std::printf("  prefill time by kind of op (%.1f ms in all):\n", 1e3 * prefill_total_s / reps);
      print_profile(prefill_profile, prefill_total_s, reps, bandwidth);
      std::printf("  decode time per token by kind of op (%.2f ms in all):\n", 1e3 * decode_total_s / decoded);
      print_profile(profile, decode_total_s, decoded, decode_bandwidth);
      if (a.threads != 1)
        std::printf("    of all that, %.2f ms (%.0f%%) the calling thread waited, its share of a job done, for "
                    "the other threads' (%.1f jobs a token)\n",
                    1e3 * decode_pool.caller_wait_seconds / decoded,
                    100 * decode_pool.caller_wait_seconds / decode_total_s, static_cast<double>(decode_pool.jobs) / decoded);
    }
  }
  return 0;
}
