// Rejection sampling must leave the target's distribution exactly unchanged, with the request's
// truncation applied to both sides. A chi-square test over many seeded verifications on a small
// vocabulary checks the emitted tokens against the target distributions; the same test applied to
// deliberately wrong acceptance rules must fail, so it can catch a broken verifier.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/dispatch.h"
#include "sample/sampler.h"
#include "spec/ngram_proposer.h"
#include "spec/rejection_sampler.h"

namespace moat {
namespace {

const ops::OpTable& table() {
  static const ops::OpTable t = *ops::OpTable::resolve(
      ops::Backend::cpu, {.matmul_dtypes = {DType::BF16}, .heads_per_rank = 16, .attention_head_dim = 576,
                          .num_experts = 64, .top_k = 6});
  return t;
}

constexpr int64_t kVocab = 8;
constexpr int64_t kDrafts = 3;

// Pearson's statistic of observed counts against probabilities; a token observed where the
// expected probability is 0 makes it infinite.
double chi_square(const std::vector<int64_t>& observed, const float* p, int64_t n) {
  double stat = 0.0;
  for (int64_t t = 0; t < kVocab; ++t) {
    const double expected = static_cast<double>(p[t]) * n;
    if (expected == 0.0) {
      if (observed[t] > 0) return INFINITY;
      continue;
    }
    stat += (observed[t] - expected) * (observed[t] - expected) / expected;
  }
  return stat;
}
// Upper 1e-4 tail of chi-square with up to 7 degrees of freedom is below 30: a correct sampler
// fails with probability < 1e-4 per position, and the seeds are fixed.
constexpr double kCritical = 30.0;

// Wrong rules, written out here: the classic bug of resampling a rejection from the target
// itself instead of the residual max(0, p - q), and accepting every guess (the draft's
// distribution). (Accepting with probability p(x) and resampling from p without x, whatever
// distribution x came from, is NOT wrong: it is exact too, and the verifier uses it for
// deterministic proposers.)
enum class Rule { correct, resample_from_target, always_accept };

struct Distributions {
  std::vector<float> target;  // [kDrafts + 1, kVocab] after truncation
  std::vector<float> draft;   // [kDrafts, kVocab]
};

// Target and draft distributions from random logits through the sampler's own truncation
// (temperature 0.8, top-k 5, top-p 0.9), as the engine computes them.
Distributions make_setup(uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_k = 5;
  params.top_p = 0.9f;
  Sampler sampler(table());
  Distributions s;
  std::vector<float> logits(kVocab);
  auto dist = [&](std::vector<float>& out) {
    for (float& l : logits) l = normal(gen);
    std::vector<float> p(kVocab);
    sampler.probabilities(logits.data(), kVocab, params, p.data());
    out.insert(out.end(), p.begin(), p.end());
  };
  for (int64_t i = 0; i <= kDrafts; ++i) dist(s.target);
  for (int64_t i = 0; i < kDrafts; ++i) dist(s.draft);
  return s;
}

// Emitted tokens at positions 0 and 1 over n verifications, each with fresh drafts from q.
std::pair<std::vector<int64_t>, std::vector<int64_t>> run(const Distributions& s, Rule rule, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> first(kVocab, 0), second(kVocab, 0);
  std::vector<float> target(s.target.size());
  std::vector<int32_t> drafts(kDrafts);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int64_t it = 0; it < n; ++it) {
    for (int64_t i = 0; i < kDrafts; ++i) {  // x_i ~ q_i
      float u = uniform(rng), cum = 0.0f;
      drafts[i] = kVocab - 1;
      for (int32_t t = 0; t < kVocab; ++t)
        if ((cum += s.draft[i * kVocab + t]) > u && s.draft[i * kVocab + t] > 0.0f) {
          drafts[i] = t;
          break;
        }
      while (s.draft[i * kVocab + drafts[i]] == 0.0f) --drafts[i];
    }
    std::vector<int32_t> emitted;
    if (rule == Rule::always_accept) {
      emitted = drafts;
    } else if (rule == Rule::resample_from_target) {
      int64_t i = 0;
      for (; i < kDrafts; ++i) {
        const int32_t x = drafts[i];
        if (uniform(rng) * s.draft[i * kVocab + x] >= s.target[i * kVocab + x]) break;
        emitted.push_back(x);
      }
      const float u = uniform(rng);
      int32_t token = -1;
      table().sample_from_probs(s.target.data() + i * kVocab, 1, kVocab, &u, &token);
      emitted.push_back(token);
    } else {
      target = s.target;
      const Verification v = verify_proposal(
          table(), target.data(),
          s.draft, drafts, kVocab, rng);
      emitted.assign(drafts.begin(), drafts.begin() + v.accepted);
      emitted.push_back(v.token);
    }
    ++first[emitted[0]];
    if (emitted.size() > 1) ++second[emitted[1]];
  }
  return {first, second};
}

int64_t total(const std::vector<int64_t>& c) {
  int64_t n = 0;
  for (int64_t v : c) n += v;
  return n;
}

TEST(RejectionSampler, EmittedTokensFollowTheTargetDistribution) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const Distributions s = make_setup(seed);
    auto [first, second] = run(s, Rule::correct, 60000, seed * 7919);
    EXPECT_LT(chi_square(first, s.target.data(), total(first)), kCritical) << "position 0, setup " << seed;
    EXPECT_LT(chi_square(second, s.target.data() + kVocab, total(second)), kCritical) << "position 1, setup " << seed;
    EXPECT_GT(total(second), 1000) << "too few acceptances to test position 1";
  }
}

TEST(RejectionSampler, TheTestCatchesWrongAcceptanceRules) {
  for (Rule wrong : {Rule::resample_from_target, Rule::always_accept}) {
    const Distributions s = make_setup(1);
    auto [first, second] = run(s, wrong, 60000, 12345);
    EXPECT_GT(chi_square(first, s.target.data(), total(first)), kCritical)
        << "rule " << static_cast<int>(wrong) << " went unnoticed";
  }
}

TEST(RejectionSampler, DeterministicProposalsKeepTheTargetDistribution) {
  // n-gram guesses come from no distribution: accepted with probability p(x), resampled from p
  // without x. Exact whatever picked x, here the draft distributions.
  for (uint32_t seed : {4u, 5u}) {
    const Distributions s = make_setup(seed);
    std::mt19937_64 rng(seed);
    std::vector<int64_t> first(kVocab, 0);
    std::vector<float> target(s.target.size());
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (int it = 0; it < 60000; ++it) {
      std::vector<int32_t> drafts(kDrafts);
      for (auto& d : drafts) d = static_cast<int32_t>(uniform(rng) * kVocab) % kVocab;  // any guess, even impossible ones
      target = s.target;
      const Verification v = verify_proposal(table(), target.data(), {}, drafts, kVocab, rng);
      ++first[v.accepted > 0 ? drafts[0] : v.token];
    }
    EXPECT_LT(chi_square(first, s.target.data(), total(first)), kCritical) << "setup " << seed;
  }
}

TEST(RejectionSampler, GreedyTargetsAcceptExactlyTheMatchingPrefix) {
  // one-hot targets at 3, 1, 4, 6; drafts agree on the first two
  std::vector<float> target((kDrafts + 1) * kVocab, 0.0f);
  const int32_t argmax[] = {3, 1, 4, 6};
  for (int64_t i = 0; i <= kDrafts; ++i) target[i * kVocab + argmax[i]] = 1.0f;
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> p = target;
    const std::vector<int32_t> drafts = {3, 1, 5};
    const Verification v = verify_proposal(table(), p.data(), {}, drafts, kVocab, rng);
    EXPECT_EQ(v.accepted, 2);
    EXPECT_EQ(v.token, 4);
    p = target;
    const std::vector<int32_t> all = {3, 1, 4};
    const Verification b = verify_proposal(table(), p.data(), {}, all, kVocab, rng);
    EXPECT_EQ(b.accepted, 3);
    EXPECT_EQ(b.token, 6) << "the bonus token comes from the last row";
  }
}

TEST(NgramProposer, LooksUpTheMostRecentLongestSuffixMatch) {
  // ... 1 2 3 9 ... 1 2 3 7 8 ... 1 2 3  -> the most recent continuation of "1 2 3" is 7 8
  const std::vector<int32_t> tokens = {5, 1, 2, 3, 9, 4, 1, 2, 3, 7, 8, 6, 1, 2, 3};
  EXPECT_EQ(NgramProposer::lookup(tokens, 2, 4, 2), (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(NgramProposer::lookup(tokens, 2, 4, 5), (std::vector<int32_t>{7, 8, 6, 1, 2}));
  // no recurring suffix of length >= 2
  EXPECT_TRUE(NgramProposer::lookup(std::vector<int32_t>{1, 2, 3, 4}, 2, 4, 3).empty());
  // a continuation that runs into the end of the context is cut there
  EXPECT_EQ(NgramProposer::lookup(std::vector<int32_t>{1, 2, 1, 2}, 2, 2, 5), (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(NgramProposer::lookup(std::vector<int32_t>{7}, 1, 3, 3).empty());
}

}  // namespace
}  // namespace moat
