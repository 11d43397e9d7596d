// The sampler against independent re-implementations written in this file from the definitions
// (no numpy or torch on these machines): bias and penalties by hand on small rows and against a
// dense O(vocab) re-implementation on random ones; logprobs against a double-precision
// log_softmax; the draw against the renormalized distribution by a chi-square test with a fixed
// seed (it cannot flake); per-row parameters in a mixed batch against each row alone; seeded runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops/dispatch.h"
#include "sample/sampler.h"

namespace moat {
namespace {

const ops::OpTable& table(ops::Backend backend = ops::Backend::cpu) {
  static const ops::ModelOpNeeds needs{.matmul_dtypes = {DType::BF16},
                                       .heads_per_rank = 16,
                                       .attention_head_dim = 576,
                                       .num_experts = 64,
                                       .top_k = 6};
  static const ops::OpTable cpu = *ops::OpTable::resolve(ops::Backend::cpu, needs);
  static const ops::OpTable ref = *ops::OpTable::resolve(ops::Backend::reference, needs);
  return backend == ops::Backend::cpu ? cpu : ref;
}

std::vector<float> randn(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::string error_of(const SamplingParams& p, int64_t vocab) {
  const Status s = p.validate(vocab);
  return s.ok() ? "ok" : s.error().message;
}

TEST(SamplingParams, ValidateNamesTheParameterAndTheRange) {
  EXPECT_EQ(error_of({}, 32000), "ok");
  EXPECT_EQ(error_of({.top_p = 1.5f}, 32000), "top_p must be in (0, 1], got 1.5");
  EXPECT_EQ(error_of({.top_p = 0.0f}, 32000), "top_p must be in (0, 1], got 0");
  EXPECT_EQ(error_of({.min_p = -0.5f}, 32000), "min_p must be in [0, 1], got -0.5");
  EXPECT_EQ(error_of({.temperature = -1.0f}, 32000), "temperature must be >= 0 (0: greedy), got -1");
  EXPECT_EQ(error_of({.top_k = -2}, 32000), "top_k must be -1, 0 (disabled) or positive, got -2");
  EXPECT_EQ(error_of({.presence_penalty = 3.0f}, 32000), "presence_penalty must be in [-2, 2], got 3");
  EXPECT_EQ(error_of({.frequency_penalty = -2.5f}, 32000), "frequency_penalty must be in [-2, 2], got -2.5");
  EXPECT_EQ(error_of({.repetition_penalty = 0.0f}, 32000), "repetition_penalty must be > 0 (1: off), got 0");
  EXPECT_EQ(error_of({.top_logprobs = 21}, 32000), "top_logprobs must be in [0, 20], got 21");
  EXPECT_EQ(error_of({.logit_bias = {{70000, 1.0f}}}, 32000), "logit_bias: token id 70000 outside the vocabulary of 32000");
  EXPECT_EQ(error_of({.logit_bias = {{-1, 1.0f}}}, 0), "logit_bias: token id -1 must be >= 0");
  EXPECT_EQ(error_of({.logit_bias = {{5, 300.0f}}}, 32000), "logit_bias: the bias of token id 5 must be in [-100, 100], got 300");
  EXPECT_EQ(error_of({.logit_bias = {{5, 1.0f}, {7, 1.0f}, {5, 2.0f}}}, 32000), "logit_bias: token id 5 given more than once");
  EXPECT_EQ(error_of({.top_p = NAN}, 32000), "top_p must be in (0, 1], got nan");
  EXPECT_EQ(error_of({.presence_penalty = 2.0f, .frequency_penalty = -2.0f, .repetition_penalty = 1.3f,
                      .logit_bias = {{31999, -100.0f}}, .logprobs = true, .top_logprobs = 20},
                     32000),
            "ok");
}

// Worked by hand from the definitions. logits {2, -1, 0.5, -3, 1, 0}; prompt {0, 3}; output
// {1, 1, 2, 0}; logit_bias {4: +1.5, 5: -100}; repetition 2, frequency 0.5, presence 0.25.
//   bias:        l4 = 1 + 1.5 = 2.5, l5 = -100
//   repetition:  seen {0, 1, 2, 3}: l0 = 2 / 2 = 1, l1 = -1 * 2 = -2, l2 = 0.5 / 2 = 0.25, l3 = -3 * 2 = -6
//   freq + pres: counts {1: 2, 2: 1, 0: 1}: l1 = -2 - 1 - 0.25 = -3.25, l2 = 0.25 - 0.5 - 0.25 = -0.5,
//                l0 = 1 - 0.5 - 0.25 = 0.25
TEST(Sampler, BiasAndPenaltiesByHand) {
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, -3.0f, 1.0f, 0.0f};
  const SamplingParams p{.temperature = 0.0f, .presence_penalty = 0.25f, .frequency_penalty = 0.5f,
                         .repetition_penalty = 2.0f, .logit_bias = {{4, 1.5f}, {5, -100.0f}}};
  const std::vector<int32_t> prompt = {0, 3}, output = {1, 1, 2, 0};
  const SamplingRow row{.params = &p, .prompt_tokens = prompt, .output_tokens = output};
  SampledToken out;
  Sampler sampler(table());
  sampler.sample(logits.data(), 1, 6, {&row, 1}, {&out, 1});
  EXPECT_EQ(logits, (std::vector<float>{0.25f, -3.25f, -0.5f, -6.0f, 2.5f, -100.0f}));
  EXPECT_EQ(out.token, 4);

  // Presence and frequency see output tokens only: a prompt-only token is untouched by them.
  std::vector<float> l2 = {1.0f, 1.0f, 1.0f};
  const SamplingParams q{.temperature = 0.0f, .presence_penalty = 1.0f, .frequency_penalty = 1.0f};
  const std::vector<int32_t> prompt2 = {0}, output2 = {2, 2, 2};
  const SamplingRow row2{.params = &q, .prompt_tokens = prompt2, .output_tokens = output2};
  sampler.sample(l2.data(), 1, 3, {&row2, 1}, {&out, 1});
  EXPECT_EQ(l2, (std::vector<float>{1.0f, 1.0f, 1.0f - 3.0f - 1.0f}));
  // A negative repetition penalty direction: p < 1 favours seen tokens (divides positives by < 1).
  std::vector<float> l3 = {2.0f, -2.0f, 2.0f};
  const SamplingParams r{.temperature = 0.0f, .repetition_penalty = 0.5f};
  const SamplingRow row3{.params = &r, .prompt_tokens = std::span<const int32_t>(prompt2), .output_tokens = {}};
  const std::vector<int32_t> out3 = {1};
  const SamplingRow row3b{.params = &r, .prompt_tokens = prompt2, .output_tokens = out3};
  sampler.sample(l3.data(), 1, 3, {&row3b, 1}, {&out, 1});
  EXPECT_EQ(l3, (std::vector<float>{4.0f, -1.0f, 2.0f}));
  (void)row3;
}

// The dense, O(vocab) way, straight from the definitions: masks and counts over the vocabulary.
void straightforward_processing(std::vector<float>& l, const SamplingParams& p, const std::vector<int32_t>& prompt,
                                const std::vector<int32_t>& output) {
  const size_t V = l.size();
  for (const auto& [id, b] : p.logit_bias) l[id] += b;
  std::vector<int> count(V, 0);
  std::vector<bool> seen(V, false);
  for (int32_t t : prompt) seen[t] = true;
  for (int32_t t : output) seen[t] = true, ++count[t];
  for (size_t i = 0; i < V; ++i) {
    if (seen[i]) l[i] = l[i] > 0 ? l[i] / p.repetition_penalty : l[i] * p.repetition_penalty;
    l[i] -= p.frequency_penalty * static_cast<float>(count[i]);
    l[i] -= p.presence_penalty * (count[i] > 0 ? 1.0f : 0.0f);
  }
}

TEST(Sampler, PenaltiesAndBiasMatchAStraightforwardReimplementation) {
  std::mt19937 rng(3);
  const int64_t V = 1000, R = 6;
  std::uniform_int_distribution<int32_t> tok(0, 49);  // a small range: many repeats
  std::uniform_real_distribution<float> pen(-2.0f, 2.0f), rep(0.5f, 1.8f), bias(-5.0f, 5.0f);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<SamplingParams> params(R);
    std::vector<std::vector<int32_t>> prompts(R), outputs(R);
    for (int64_t r = 0; r < R; ++r) {
      SamplingParams& p = params[r];
      p.temperature = 0.0f;
      p.presence_penalty = r % 3 == 0 ? 0.0f : pen(rng);
      p.frequency_penalty = r % 2 == 0 ? pen(rng) : 0.0f;
      p.repetition_penalty = r == 1 ? 1.0f : rep(rng);
      for (int32_t id : {3, 17, 990, 40}) p.logit_bias.emplace_back(id + static_cast<int32_t>(r), bias(rng));
      for (int i = 0; i < 30; ++i) prompts[r].push_back(tok(rng));
      for (int i = 0; i < trial * 3; ++i) outputs[r].push_back(tok(rng) + 20);
    }
    auto logits = randn(static_cast<size_t>(R * V), 100 + trial, 3.0f);
    std::vector<float> expected;
    for (int64_t r = 0; r < R; ++r) {
      std::vector<float> row(logits.begin() + r * V, logits.begin() + (r + 1) * V);
      straightforward_processing(row, params[r], prompts[r], outputs[r]);
      expected.insert(expected.end(), row.begin(), row.end());
    }
    std::vector<SamplingRow> rows;
    for (int64_t r = 0; r < R; ++r) rows.push_back({&params[r], nullptr, prompts[r], outputs[r]});
    std::vector<SampledToken> out(R);
    Sampler sampler(table());
    sampler.sample(logits.data(), R, V, rows, out);
    for (int64_t i = 0; i < R * V; ++i) ASSERT_FLOAT_EQ(logits[i], expected[i]) << "trial " << trial << " at " << i;
    for (int64_t r = 0; r < R; ++r)
      EXPECT_EQ(out[r].token, std::max_element(expected.begin() + r * V, expected.begin() + (r + 1) * V) -
                                  (expected.begin() + r * V));
  }
}

// log_softmax in double, straight from the definition.
std::vector<double> log_softmax(const float* l, int64_t V) {
  const double m = *std::max_element(l, l + V);
  double s = 0.0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(static_cast<double>(l[i]) - m);
  std::vector<double> out(V);
  for (int64_t i = 0; i < V; ++i) out[i] = l[i] - m - std::log(s);
  return out;
}

TEST(Sampler, LogprobsAreLogSoftmaxOfTheProcessedLogitsBeforeTemperature) {
  const int64_t V = 5000, R = 4;
  auto logits = randn(static_cast<size_t>(R * V), 7, 2.0f);
  logits[2 * V + 10] = logits[2 * V + 11] = 9.0f;  // a tie at the top: lower id first
  const std::vector<SamplingParams> params = {
      {.temperature = 0.0f, .logprobs = true, .top_logprobs = 5},
      {.temperature = 0.5f, .top_k = 3, .seed = 1, .presence_penalty = 1.0f, .logit_bias = {{42, 8.0f}},
       .logprobs = true, .top_logprobs = 20},
      {.temperature = 1.3f, .seed = 2, .logprobs = false, .top_logprobs = 3},
      {.temperature = 1.0f, .seed = 3},  // no logprobs asked
  };
  const std::vector<int32_t> output = {42, 7, 7};
  std::vector<std::mt19937_64> rngs = {std::mt19937_64(0), std::mt19937_64(1), std::mt19937_64(2), std::mt19937_64(3)};
  std::vector<SamplingRow> rows;
  for (int64_t r = 0; r < R; ++r) rows.push_back({&params[r], &rngs[r], {}, output});
  std::vector<SampledToken> out(R);
  Sampler(table()).sample(logits.data(), R, V, rows, out);  // logits now hold the processed rows
  for (int64_t r = 0; r < 3; ++r) {
    const auto ref = log_softmax(logits.data() + r * V, V);
    if (params[r].wants_logprobs()) {
      EXPECT_NEAR(out[r].logprob, ref[out[r].token], 1e-5) << r;
    }
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ref[a] > ref[b]; });
    ASSERT_EQ(out[r].top_logprobs.size(), static_cast<size_t>(params[r].top_logprobs)) << r;
    for (int32_t i = 0; i < params[r].top_logprobs; ++i) {
      EXPECT_EQ(out[r].top_logprobs[i].first, order[i]) << r << " " << i;
      EXPECT_NEAR(out[r].top_logprobs[i].second, ref[order[i]], 1e-5) << r << " " << i;
    }
  }
  EXPECT_EQ(out[2].top_logprobs[0].first, 10);  // the tie
  EXPECT_EQ(out[2].top_logprobs[1].first, 11);
  EXPECT_FALSE(std::isnan(out[2].logprob));  // top_logprobs alone brings the chosen one too
  EXPECT_TRUE(std::isnan(out[3].logprob));
  EXPECT_TRUE(out[3].top_logprobs.empty());
  EXPECT_EQ(out[1].top_logprobs[0].first, 42);  // the bias shows in the logprobs
}

// The distribution after temperature and the truncations, in double from the definitions
// (DESIGN.md "Sampling semantics").
std::vector<double> expected_distribution(const std::vector<float>& l, const SamplingParams& p) {
  const size_t V = l.size();
  std::vector<double> q(V);
  const double m = *std::max_element(l.begin(), l.end());
  for (size_t i = 0; i < V; ++i) q[i] = std::exp((l[i] - m) / p.temperature);
  auto renorm = [&] {
    const double s = std::accumulate(q.begin(), q.end(), 0.0);
    for (double& x : q) x /= s;
  };
  auto keep_at_least = [&](double t) {
    for (double& x : q)
      if (x < t) x = 0.0;
  };
  renorm();
  auto sorted = [&] {
    std::vector<double> s = q;
    std::sort(s.begin(), s.end(), std::greater<double>());
    return s;
  };
  if (p.top_k > 0 && p.top_k < static_cast<int32_t>(V)) keep_at_least(sorted()[p.top_k - 1]), renorm();
  if (p.top_p < 1.0f) {
    const auto s = sorted();
    double cum = 0.0;
    for (double x : s)
      if ((cum += x) >= p.top_p) {
        keep_at_least(x);
        break;
      }
    renorm();
  }
  if (p.min_p > 0.0f) keep_at_least(p.min_p * sorted()[0]), renorm();
  return q;
}

TEST(Sampler, ProbabilitiesAreTheRenormalizedDistribution) {
  const auto logits = randn(64, 9, 1.5f);
  for (const SamplingParams& p : {SamplingParams{.temperature = 0.7f, .top_k = 10, .top_p = 0.8f, .min_p = 0.05f},
                                  SamplingParams{.temperature = 1.0f}, SamplingParams{.temperature = 2.0f, .top_p = 0.5f},
                                  SamplingParams{.temperature = 0.3f, .min_p = 0.2f}}) {
    const auto expected = expected_distribution(logits, p);
    for (ops::Backend b : {ops::Backend::cpu, ops::Backend::reference}) {
      std::vector<float> probs(64);
      Sampler(table(b)).probabilities(logits.data(), 64, p, probs.data());
      for (int i = 0; i < 64; ++i) {
        EXPECT_NEAR(probs[i], expected[i], 1e-6) << i;
        EXPECT_EQ(probs[i] == 0.0f, expected[i] == 0.0) << i;
      }
    }
  }
  // Greedy: one-hot at the argmax (lowest id on ties), what sample() would pick.
  std::vector<float> l = {0.0f, 3.0f, 1.0f, 3.0f}, probs(4);
  Sampler(table()).probabilities(l.data(), 4, SamplingParams{.temperature = 0.0f}, probs.data());
  EXPECT_EQ(probs, (std::vector<float>{0.0f, 1.0f, 0.0f, 0.0f}));
}

// Pearson's chi-square of 40000 draws against the renormalized distribution, fixed seed: with the
// truncated tokens never drawn and the statistic under the 0.1% point of chi-square.
TEST(Sampler, DrawsFollowTheRenormalizedDistribution) {
  const int64_t V = 12;
  const auto logits = randn(V, 11, 1.0f);
  const SamplingParams p{.temperature = 0.8f, .top_k = 9, .top_p = 0.9f, .min_p = 0.05f, .seed = 5};
  const auto expected = expected_distribution(logits, p);
  std::mt19937_64 rng(*p.seed);
  Sampler sampler(table());
  const int N = 40000;
  std::vector<int> counts(V, 0);
  for (int i = 0; i < N; ++i) ++counts[sampler.sample(logits.data(), V, p, rng)];
  double chi2 = 0.0;
  int df = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " was truncated away";
      continue;
    }
    const double e = expected[i] * N;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++df;
  }
  ASSERT_GE(df, 2);
  // 0.1% points of chi-square for df = 2..11.
  const double crit[] = {0, 0, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26};
  EXPECT_LT(chi2, crit[df]) << "df " << df;
}

// A greedy row, a top-k = 1 row, seeded sampling rows with different truncations and one with
// penalties in one batch: each row's token (over several steps) is what that row gives alone.
TEST(Sampler, MixedBatchRowsEqualEachRowAlone) {
  for (int64_t V : {1000, 160000}) {
    const int64_t R = 6;
    const std::vector<SamplingParams> params = {
        {.temperature = 0.0f},
        {.temperature = 1.0f, .top_k = 1, .seed = 1},
        {.temperature = 0.8f, .top_p = 0.9f, .seed = 2},
        {.temperature = 1.2f, .top_k = 50, .min_p = 0.1f, .seed = 3},
        {.temperature = 0.8f, .top_p = 0.9f, .seed = 4, .presence_penalty = 0.5f, .frequency_penalty = 0.3f,
         .repetition_penalty = 1.2f, .logit_bias = {{5, 3.0f}}},
        {.temperature = 0.0f, .repetition_penalty = 1.5f},
    };
    const std::vector<int32_t> prompt = {5, 6, 7, 5};
    std::vector<std::mt19937_64> batch_rngs, alone_rngs;
    for (const auto& p : params) batch_rngs.emplace_back(p.seed.value_or(0)), alone_rngs.emplace_back(p.seed.value_or(0));
    std::vector<std::vector<int32_t>> batch_out(R), alone_out(R);
    Sampler batch_sampler(table()), alone_sampler(table());
    for (int step = 0; step < 4; ++step) {
      auto logits = randn(static_cast<size_t>(R * V), 50 + step, 2.0f);
      std::vector<SamplingRow> rows;
      for (int64_t r = 0; r < R; ++r) rows.push_back({&params[r], &batch_rngs[r], prompt, batch_out[r]});
      std::vector<SampledToken> out(R);
      auto batch_logits = logits;
      batch_sampler.sample(batch_logits.data(), R, V, rows, out);
      for (int64_t r = 0; r < R; ++r) {
        std::vector<float> alone(logits.begin() + r * V, logits.begin() + (r + 1) * V);
        const SamplingRow row{&params[r], &alone_rngs[r], prompt, alone_out[r]};
        SampledToken one;
        alone_sampler.sample(alone.data(), 1, V, {&row, 1}, {&one, 1});
        alone_out[r].push_back(one.token);
        batch_out[r].push_back(out[r].token);
        EXPECT_EQ(out[r].token, one.token) << "V " << V << " row " << r << " step " << step;
        if (r == 1) {  // top-k = 1 is the argmax
          EXPECT_EQ(one.token, std::max_element(alone.begin(), alone.end()) - alone.begin());
        }
      }
    }
  }
}

// The cpu kernels and the reference kernels draw the same tokens from the same seeds.
TEST(Sampler, CpuAndReferenceBackendsDrawTheSameTokens) {
  const int64_t V = 50000, R = 4;
  const std::vector<SamplingParams> params = {
      {.temperature = 0.9f, .top_k = 40, .seed = 1},
      {.temperature = 1.0f, .top_p = 0.95f, .seed = 2},
      {.temperature = 0.7f, .min_p = 0.02f, .seed = 3},
      {.temperature = 1.0f, .top_k = 100, .top_p = 0.8f, .min_p = 0.01f, .seed = 4},
  };
  std::vector<std::mt19937_64> a, b;
  for (const auto& p : params) a.emplace_back(*p.seed), b.emplace_back(*p.seed);
  Sampler cpu(table(ops::Backend::cpu)), ref(table(ops::Backend::reference));
  for (int step = 0; step < 5; ++step) {
    auto l1 = randn(static_cast<size_t>(R * V), 70 + step, 3.0f), l2 = l1;
    std::vector<SamplingRow> ra, rb;
    for (int64_t r = 0; r < R; ++r) ra.push_back({&params[r], &a[r], {}, {}}), rb.push_back({&params[r], &b[r], {}, {}});
    std::vector<SampledToken> oa(R), ob(R);
    cpu.sample(l1.data(), R, V, ra, oa);
    ref.sample(l2.data(), R, V, rb, ob);
    for (int64_t r = 0; r < R; ++r) EXPECT_EQ(oa[r].token, ob[r].token) << "row " << r << " step " << step;
  }
}

TEST(Sampler, SeededRunsAreReproducible) {
  const int64_t V = 3000;
  const auto logits = randn(V, 13, 0.5f);  // flat enough that two seeds surely differ
  auto run = [&](uint64_t seed) {
    const SamplingParams p{.temperature = 1.0f, .top_p = 0.95f, .seed = seed};
    std::mt19937_64 rng(seed);
    Sampler sampler(table());
    std::vector<int32_t> tokens;
    for (int i = 0; i < 50; ++i) tokens.push_back(sampler.sample(logits.data(), V, p, rng));
    return tokens;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, OneRowCallsKeepTheCallersLogitsAndApplyBias) {
  std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  const auto before = logits;
  const SamplingParams p{.temperature = 0.0f, .logit_bias = {{0, 5.0f}}};
  std::mt19937_64 rng(0);
  Sampler sampler(table());
  EXPECT_EQ(sampler.sample(logits.data(), 3, p, rng), 0);
  EXPECT_EQ(logits, before);
  EXPECT_EQ(sampler.sample(logits.data(), 3, SamplingParams{.temperature = 0.0f}, rng), 2);
}

}  // namespace
}  // namespace moat
