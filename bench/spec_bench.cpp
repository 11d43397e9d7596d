// Single-stream speculative decoding: decode tok/s with and without each proposer, next to the
// cost model that explains the ratio. Per (temperature, method, k):
//   tok/s, speedup over plain decoding in the same run, acceptance rate (accepted / guessed),
//   mean accepted length (tokens emitted per verification step, the target's own included), and
//   the predicted speedup E / (g * c_guess / c_target + c_verify(round(g) + 1) / c_target), from
//     g              guesses per verification step (k, fewer when adaptive k shrinks it),
//     c_target       one plain decode step of the target (timed directly),
//     c_guess        one proposer step: the draft's decode step, the MTP head's one-token forward
//                    (checkpoints with MTP layers run that proposer too), 0 for n-gram,
//     c_verify(n)    one target forward over n tokens at the same context (timed directly):
//                    more than c_target because n tokens touch more routed experts
//                    (E * (1 - (1 - top_k / E)^n) per MoE layer) and do n tokens' FLOPs.
//   --profile prints only c_verify(k + 1) and c_target by kind of op.
//
//   spec_bench --model DIR [--draft DIR] [--threads N] [--tokens 128] [--k 2,4,6]
//              [--temperatures 0,0.7] [--markdown] [--profile]
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <sstream>

#include "base/thread_pool.h"
#include "engine/engine.h"

namespace {

using namespace moat;
using Clock = std::chrono::steady_clock;

struct Run {
  double tok_s = 0;           // decode tokens (after the first) per second of decode
  double ms_per_step = 0;     // decode time / engine steps after the first token
  EngineStats stats;
};

// Decodes every prompt to `tokens` tokens, one request at a time.
Run decode(DeepseekModel& model, const std::vector<std::vector<int32_t>>& prompts, int64_t tokens, float temperature,
           const SpeculativeConfig& spec) {
  EngineConfig c;
  c.max_model_len = model.max_context();
  c.max_num_seqs = 1;
  c.speculative = spec;
  auto engine = Engine::create(model, c);
  if (!engine) {
    std::fprintf(stderr, "spec_bench: %s\n", engine.error().message.c_str());
    std::exit(1);
  }
  double decode_s = 0;
  int64_t decode_tokens = 0, decode_steps = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt = prompts[i];
    r.sampling.temperature = temperature;
    r.sampling.seed = 1000 + i;
    r.stop.max_tokens = tokens;
    r.stop.ignore_eos = true;
    (void)(*engine)->add_request(r);
    std::optional<Clock::time_point> first;
    int64_t steps = 0, got = 0;
    while ((*engine)->has_work()) {
      for (const RequestOutput& o : (*engine)->step()) {
        got += static_cast<int64_t>(o.new_tokens.size());
        if (!first && !o.new_tokens.empty()) first = Clock::now();
        else if (first) ++steps;
      }
    }
    decode_s += std::chrono::duration<double>(Clock::now() - *first).count();
    decode_tokens += got - 1;
    decode_steps += steps;
  }
  return {decode_tokens / decode_s, 1000.0 * decode_s / std::max<int64_t>(1, decode_steps), (*engine)->stats()};
}

// Milliseconds of one forward over n tokens after a context of `context` tokens; with a profile,
// where that time goes by kind of op (per forward). An MTP head's second input, the main model's
// hidden state, is random here: only the time is used.
double forward_ms(DeepseekModel& model, int64_t context, int64_t n, ops::OpProfile* profile = nullptr) {
  SequenceCache cache = model.new_sequence_cache(context + n);
  std::vector<int32_t> tokens(static_cast<size_t>(context + n));
  std::mt19937 rng(7);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % model.config().vocab_size);
  std::vector<float> logits(static_cast<size_t>((context + n) * model.config().vocab_size));
  std::vector<float> prev_hidden(static_cast<size_t>((context + n) * model.config().hidden_size));
  std::normal_distribution<float> normal;
  for (float& h : prev_hidden) h = normal(rng);
  auto forward = [&](std::span<const int32_t> step, int64_t first, ForwardBatch::Logits which) {
    if (!model.is_mtp()) return model.forward(cache, step, static_cast<int32_t>(first), logits.data(), which);
    ForwardBatch batch = ForwardBatch::for_sequence(step, static_cast<int32_t>(first), cache.blocks,
                                                    cache.pages.block_size(), which);
    batch.state_slots = {cache.state_slot};
    model.forward(batch, cache.pages, logits.data(), nullptr,
                  {.mtp_prev_hidden = prev_hidden.data(), .states = &cache.states});
  };
  forward(std::span(tokens).first(context), 0, ForwardBatch::Logits::last);
  const std::span<const int32_t> step = std::span(tokens).subspan(context);
  forward(step, context, ForwardBatch::Logits::all);  // warm
  const int reps = 20;
  model.set_op_profile(profile);
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) forward(step, context, ForwardBatch::Logits::all);
  model.set_op_profile(nullptr);
  if (profile)
    for (auto& b : profile->buckets) b.seconds /= reps, b.weight_bytes /= reps, b.calls /= reps;
  return 1000.0 * std::chrono::duration<double>(Clock::now() - t0).count() / reps;
}

// Reads one byte of every page of the model's checkpoint files: a checkpoint another benchmark
// pushed out of the page cache would otherwise be read from disk during the first timed run
// (the plain one, which every speedup divides by).
void fault_in(const DeepseekModel& model) {
  unsigned sum = 0;
  for (const auto& f : model.checkpoint().files())
    for (size_t at = 0; at < f->file_size(); at += 4096) sum += static_cast<unsigned>(f->mapping()[at]);
  asm volatile("" : : "r"(sum));  // the reads must happen
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"single-stream speculative decoding benchmark"};
  std::string model_dir, draft_dir, k_list = "2,4,6", temp_list = "0,0.7";
  int threads = 1;
  int64_t tokens = 128;
  bool markdown = false, profile = false;
  app.add_option("--model", model_dir)->required();
  app.add_option("--draft", draft_dir, "draft model (same vocabulary); without it only n-gram runs");
  app.add_option("--threads", threads);
  app.add_option("--tokens", tokens, "tokens generated per prompt");
  app.add_option("--k", k_list, "speculative tokens per step, comma separated");
  app.add_option("--temperatures", temp_list);
  app.add_flag("--markdown", markdown);
  app.add_flag("--profile", profile,
               "only the verification cost: the target forward over 1 and k + 1 tokens by kind of op");
  CLI11_PARSE(app, argc, argv);
  auto list = [](const std::string& s) {
    std::vector<double> v;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');) v.push_back(std::stod(item));
    return v;
  };
  const int64_t max_context = 64 + tokens + 16;
  auto loaded = DeepseekModel::load(model_dir, {.backend = ops::Backend::cpu, .max_context = max_context, .threads = threads});
  if (!loaded) return std::fprintf(stderr, "spec_bench: %s\n", loaded.error().message.c_str()), 1;
  DeepseekModel& model = **loaded;
  std::unique_ptr<DeepseekModel> draft;
  if (!draft_dir.empty()) {
    auto d = DeepseekModel::load(draft_dir, {.backend = ops::Backend::cpu, .max_context = max_context, .threads = threads});
    if (!d) return std::fprintf(stderr, "spec_bench: draft: %s\n", d.error().message.c_str()), 1;
    draft = std::move(d).value();
  }
  // A checkpoint with MTP layers (num_nextn_predict_layers > 0) also runs its own MTP head.
  std::unique_ptr<DeepseekModel> mtp;
  if (model.config().num_nextn_predict_layers > 0) {
    auto m = DeepseekModel::load(model_dir,
                                 {.backend = ops::Backend::cpu, .max_context = max_context, .threads = threads, .mtp = true});
    if (!m) return std::fprintf(stderr, "spec_bench: MTP head: %s\n", m.error().message.c_str()), 1;
    mtp = std::move(m).value();
  }
  // Prompts: the shipped tokenizer's text when the model has one, else random tokens (the bench
  // checkpoints have random weights and no tokenizer).
  std::vector<std::vector<int32_t>> prompts;
  if (auto tok = Tokenizer::load(model_dir); tok.ok()) {
    for (const char* text : {"The meaning of life is", "A computer is", "Love is", "Perl is the duct tape of"}) {
      std::vector<int32_t> p;
      if (tok->bos_id()) p.push_back(*tok->bos_id());
      for (int32_t id : tok->encode(text)) p.push_back(id);
      prompts.push_back(p);
    }
  } else {
    std::mt19937 rng(1);
    for (int i = 0; i < 4; ++i) {
      std::vector<int32_t> p(32);
      for (auto& t : p) t = static_cast<int32_t>(rng() % model.config().vocab_size);
      prompts.push_back(p);
    }
  }
  for (const DeepseekModel* m : {&model, draft.get(), mtp.get()})
    if (m) fault_in(*m);
  const int64_t context = 16 + tokens / 2;  // the mean context of a decode
  if (profile) {
    // Where verify(k+1) / step comes from: each kind of op's time over 1 token and over k + 1.
    std::vector<int64_t> ns{1};
    for (double kd : list(k_list)) ns.push_back(static_cast<int64_t>(kd) + 1);
    std::vector<ops::OpProfile> profiles(ns.size());
    std::vector<double> total_ms(ns.size());
    for (size_t i = 0; i < ns.size(); ++i) total_ms[i] = forward_ms(model, context, ns[i], &profiles[i]);
    std::printf("%s, %d threads, context %ld: target forward time (ms) by kind of op\n%-16s", model_dir.c_str(),
                threads, static_cast<long>(context), "tokens");
    for (int64_t n : ns) std::printf(" %9ld", static_cast<long>(n));
    std::printf("\n");
    auto line = [&](const char* name, auto ms_of) {
      std::printf("%-16s", name);
      for (size_t i = 0; i < ns.size(); ++i) std::printf(" %9.3f", ms_of(i));
      std::printf("\n");
    };
    for (int k = 0; k < ops::OpProfile::kNumKinds; ++k)
      line(ops::OpProfile::kNames[k], [&](size_t i) { return 1e3 * profiles[i].buckets[k].seconds; });
    line("rest", [&](size_t i) { return total_ms[i] - 1e3 * profiles[i].seconds(); });
    line("total", [&](size_t i) { return total_ms[i]; });
    line("total / step", [&](size_t i) { return total_ms[i] / total_ms[0]; });
    return 0;
  }
  const double c_target = forward_ms(model, context, 1);
  const double c_draft = draft ? forward_ms(*draft, context, 1) : 0.0;
  const double c_mtp = mtp ? forward_ms(*mtp, context, 1) : 0.0;
  if (!markdown)
    std::printf("%s%s%s, %d threads, %zu prompts x %ld tokens; target step %.3f ms%s\n", model_dir.c_str(),
                draft ? " + draft " : "", draft_dir.c_str(), threads, prompts.size(), tokens, c_target,
                draft ? (", draft step " + std::to_string(c_draft) + " ms").c_str()
                : mtp ? (", MTP head step " + std::to_string(c_mtp) + " ms").c_str() : "");
  if (!markdown)
    std::printf("%5s %-7s %3s %9s %8s %10s %10s %10s %10s %10s\n", "temp", "method", "k", "tok/s", "speedup",
                "accept %", "tok/step", "guess/step", "verify/step", "predicted");
  for (double temp : list(temp_list)) {
    const Run base = decode(model, prompts, tokens, static_cast<float>(temp), {});
    // verify(n) / step for a forward over n tokens, timed once per n
    std::map<int64_t, double> verify_ratios;
    auto verify_ratio = [&](int64_t n) {
      auto it = verify_ratios.find(n);
      if (it == verify_ratios.end()) it = verify_ratios.emplace(n, forward_ms(model, context, n) / c_target).first;
      return it->second;
    };
    auto row = [&](const std::string& method, int k, const Run& r, double c_guess) {
      // a proposer that never guessed (n-gram on random tokens finds no match) has no acceptance to show
      const bool guessed = k && r.stats.spec_steps > 0;
      // Adaptive k guesses fewer than k when guesses are rejected: the cost model takes the mean
      // guesses per verification step g, g proposer steps and a target forward over round(g) + 1.
      const double g = guessed ? static_cast<double>(r.stats.draft_tokens) / r.stats.spec_steps : 0.0;
      const double verify = guessed ? verify_ratio(std::lround(g) + 1) : 0.0;
      const double predicted = guessed ? r.stats.mean_accepted_length() / (g * c_guess / c_target + verify) : 0.0;
      auto fixed = [&](bool show, const char* f, double v) { return show ? fmt::format(fmt::runtime(f), v) : "-"; };
      if (markdown)
        std::printf("| %s | %s | %.1f | %s | %s | %.1f | %.2fx | %s | %s | %s | %s | %s | %s |\n", model_dir.c_str(),
                    method == "mtp" ? "its MTP head" : draft ? draft_dir.c_str() : "-", temp, method.c_str(),
                    k ? std::to_string(k).c_str() : "-", r.tok_s, r.tok_s / base.tok_s,
                    guessed ? fmt::format("{:.1f}", 100.0 * r.stats.acceptance_rate()).c_str() : k ? "no guesses" : "-",
                    fixed(guessed, "{:.2f}", r.stats.mean_accepted_length()).c_str(), fixed(guessed, "{:.2f}", g).c_str(),
                    fixed(guessed, "{:.2f}", verify).c_str(), fixed(k > 0, "{:.2f}", c_guess / c_target).c_str(),
                    fixed(guessed, "{:.2f}x", predicted).c_str());
      else
        std::printf("%5.1f %-7s %3d %9.1f %7.2fx %10.1f %10.2f %10.2f %10.2f %9.2fx\n", temp, method.c_str(), k, r.tok_s,
                    r.tok_s / base.tok_s, 100.0 * r.stats.acceptance_rate(), r.stats.mean_accepted_length(), g, verify,
                    predicted);
    };
    row("none", 0, base, 0);
    for (double kd : list(k_list)) {
      const int k = static_cast<int>(kd);
      for (const std::string method : {"ngram", "draft", "mtp"}) {
        if ((method == "draft" && !draft) || (method == "mtp" && !mtp)) continue;
        // a guess costs one proposer forward: the draft's step, or the MTP head's (its first
        // forward runs over the step's kept rows, the next ones over one row each)
        const double c_guess = method == "draft" ? c_draft : method == "mtp" ? c_mtp : 0.0;
        const Run r = decode(model, prompts, tokens, static_cast<float>(temp),
                             {.method = method, .num_tokens = k,
                              .draft_model = method == "mtp" ? mtp.get() : draft.get()});
        row(method, k, r, c_guess);
      }
    }
  }
  return 0;
}
