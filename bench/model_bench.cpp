// Model-level benchmark for one checkpoint at one thread count (one process per run, so peak RSS
// is this configuration's own): prefill of --prompt-tokens random tokens, then --decode-tokens
// greedy decode steps at one stream, each next to its roofline measured in the same process:
//   decode roofline  = bandwidth / (active weight bytes + latent cache bytes read per token), the
//                      bandwidth measured on the memory holding the weights (all files' mappings
//                      or copies, up to 8 GiB) when it is larger than the caches: on VMs that
//                      memory can read far slower than a freshly allocated buffer (both shown)
//   prefill roofline = bf16 peak / FLOPs per prompt (2 x active params per token + attention)
// Prints one markdown table row (--markdown) or a readable summary.
//
//   model_bench --model DIR [--threads N] [--prompt-tokens 512] [--decode-tokens 32] [--exact]
//               [--weights-in-memory] [--markdown]
#include <sys/resource.h>

#include <cstdio>
#include <random>
#include <string>

#include "base/thread_pool.h"
#include "models/deepseek_v3.h"
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
  bool exact = false;  // OpTable::set_exact_activations
  bool weights_in_memory = false;
  bool markdown = false;
};

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
    else if (s == "--exact") a.exact = true;
    else if (s == "--weights-in-memory") a.weights_in_memory = true;
    else if (s == "--markdown") a.markdown = true;
    else {
      std::fprintf(stderr, "usage: model_bench --model DIR [--threads N] [--prompt-tokens N] [--decode-tokens N] [--exact] [--weights-in-memory] [--markdown]\n");
      return 2;
    }
  }
  constexpr int64_t kWarmupDecodeSteps = 4;
  const int64_t context = a.prompt_tokens + kWarmupDecodeSteps + a.decode_tokens;
  auto loaded = DeepseekModel::load(a.model, {.backend = ops::Backend::cpu, .max_context = context,
                                              .exact_activations = a.exact,
                                              .weights = a.weights_in_memory ? WeightPlacement::memory
                                                                             : WeightPlacement::mmap,
                                              .threads = a.threads});
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

  auto prefill = [&] { model.forward(cache, prompt, 0, logits.data()); };
  // The first prefill faults the mmapped weights in; the second is the measurement.
  prefill();
  const auto p0 = std::chrono::steady_clock::now();
  prefill();
  const double prefill_s = bench::seconds_since(p0);

  int32_t next_token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  int64_t position = a.prompt_tokens;
  auto decode_step = [&] {
    model.forward(cache, std::span<const int32_t>(&next_token, 1), static_cast<int32_t>(position++), logits.data());
    next_token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  };
  // A few untimed steps first: the steady state is what a long generation sees (right after a
  // large prefill the kernel may still be settling huge pages and caches).
  for (int64_t n = 0; n < kWarmupDecodeSteps; ++n) decode_step();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < a.decode_tokens; ++n) decode_step();
  const double decode_s = bench::seconds_since(t0) / static_cast<double>(a.decode_tokens);
  const double rss = peak_rss_mib();
  const auto pages = model.checkpoint().page_stats();
  const double huge_pct = 100.0 * static_cast<double>(pages.huge) / static_cast<double>(std::max<size_t>(1, pages.resident));

  // Rooflines from this process's own measurement of the machine.
  bench::HugeBuffer<float> bw_buf((512ll << 20) / 4);
  const double fresh_bandwidth = bench::read_bandwidth_gbs(bw_buf) * 1e9;
  double bandwidth = fresh_bandwidth;
  if (model.checkpoint().total_bytes() >= (512ull << 20)) {
    // the whole checkpoint (up to 8 GiB): on a VM, regions of guest memory can differ in speed
    std::vector<std::pair<const float*, int64_t>> regions;
    size_t budget = 8ull << 30;
    for (const auto& f : model.checkpoint().files()) {
      const size_t n = std::min(f->file_size(), budget);
      budget -= n;
      regions.emplace_back(reinterpret_cast<const float*>(f->mapping()), static_cast<int64_t>(n / sizeof(float)));
    }
    bandwidth = bench::read_bandwidth_gbs(regions) * 1e9;
  }
  const double bf16_peak = bench::bf16_peak_gflops() * 1e9;

  const auto active = model.active_weights_per_token();
  const double avg_ctx = a.prompt_tokens + kWarmupDecodeSteps + a.decode_tokens / 2.0;
  const double kv_read = avg_ctx * static_cast<double>(model.cache_shape().bytes_per_token());  // bf16 latent cache
  const double decode_roof_tps = bandwidth / (active.bytes + kv_read);
  // Absorbed attention: per (query, key) pair and head, q.row over D values and the latent
  // output over kv_lora values, 2 FLOPs per multiply-add.
  const double pairs = a.prompt_tokens * (a.prompt_tokens + 1) / 2.0;
  const double attn_flops = c.num_hidden_layers * pairs * c.num_attention_heads * 2.0 * (c.kv_cache_dim() + c.kv_lora_rank);
  const double prefill_flops = 2.0 * active.params * a.prompt_tokens + attn_flops;
  const double prefill_roof_tps = a.prompt_tokens / (prefill_flops / bf16_peak);
  const double prefill_tps = a.prompt_tokens / prefill_s, decode_tps = 1.0 / decode_s;
  const double ckpt_mib = model.checkpoint().total_bytes() / 1048576.0, kv_mib = cache.pages.bytes() / 1048576.0;

  if (a.markdown) {
    std::printf("| %s | %d | %s, %s, %.0f%% | %.1f / %.1f | %.1f | %.1f | %.0f%% | %.2f | %.2f | %.0f%% | %.0f | %.0f + %.0f | %.2f |\n",
                a.model.c_str(), a.threads, a.exact ? "exact" : "default",
                a.weights_in_memory ? "in memory" : "mmap", huge_pct, bandwidth / 1e9, fresh_bandwidth / 1e9,
                prefill_tps, prefill_roof_tps,
                100 * prefill_tps / prefill_roof_tps, decode_tps, decode_roof_tps, 100 * decode_tps / decode_roof_tps,
                rss, ckpt_mib, kv_mib, rss / (ckpt_mib + kv_mib));
  } else {
    std::printf("model %s, %d thread(s), %s activations\n", a.model.c_str(), a.threads, a.exact ? "exact" : "default");
    std::printf("  resident weights in 2 MiB pages: %.0f%%\n", huge_pct);
    std::printf("  measured: bandwidth %.1f GB/s reading the weights' memory (%.1f GB/s a fresh buffer), bf16 peak %.1f GFLOPS\n",
                bandwidth / 1e9, fresh_bandwidth / 1e9, bf16_peak / 1e9);
    std::printf("  active per token: %.1f MB of weights (%.1fM params), %.1f MB of latent cache at ctx %.0f\n",
                active.bytes / 1e6, active.params / 1e6, kv_read / 1e6, avg_ctx);
    std::printf("  prefill %lld tokens: %.1f tok/s, roofline %.1f tok/s (%.0f%%), %.1f GFLOP per prompt\n",
                static_cast<long long>(a.prompt_tokens), prefill_tps, prefill_roof_tps,
                100 * prefill_tps / prefill_roof_tps, prefill_flops / 1e9);
    std::printf("  decode: %.2f tok/s, roofline %.2f tok/s (%.0f%%)\n", decode_tps, decode_roof_tps,
                100 * decode_tps / decode_roof_tps);
    std::printf("  peak RSS %.0f MiB; checkpoint %.0f MiB + KV %.0f MiB (ratio %.2f)\n", rss, ckpt_mib, kv_mib,
                rss / (ckpt_mib + kv_mib));
  }
  return 0;
}
