// The Kimi Delta Attention ops (short_conv, kda_gate, kda_recurrent, kda_chunked, gated_rms_norm):
// every host kernel (reference and cpu, each ISA this CPU runs) against the reference kernel, the
// reference against independent double loops written here from the definitions, and kda_chunked
// against kda_recurrent where a chunked form can go wrong: chunk boundaries, a sequence split over
// several calls at arbitrary points, decay strong enough to overflow a naive exp(-G), no decay.
// Step states (speculative verification: short_conv and kda_recurrent) against the final states of
// the same ops run on each prefix alone.
// Several sequences of different lengths run in every call, laid out in x in reverse order (so a
// kernel must follow seq_start), with q/k and v rows padded (strides) and states that start random
// (a sequence continuing from an earlier call) unless a test says otherwise.
//
// Error measure: normalized error = max|out - ref| / max|ref| (parity.h). Tolerances:
//   kExact 1e-5  fp32 arithmetic against the reference's double sums (short_conv, kda_gate,
//                gated_rms_norm; kda_recurrent and kda_chunked measured at most ~5e-7, states
//                included, over 300 tokens)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

constexpr double kExact = 1e-5;

using testing::normalized_error;
using testing::randn;
using testing::fn_of;
using testing::host_kernels;

const Registry& reg() { return Registry::global(); }

const KernelEntry* reference_kernel(OpId op) { return reg().kernels(op, Backend::reference).front(); }

// First token of each sequence when sequence s takes lens[s] tokens and the sequences lie in x in
// reverse order (the last one first).
std::vector<int32_t> reversed_starts(const std::vector<int32_t>& lens) {
  std::vector<int32_t> starts(lens.size());
  int32_t next = 0;
  for (size_t s = lens.size(); s-- > 0;) {
    starts[s] = next;
    next += lens[s];
  }
  return starts;
}

std::vector<float> concat(const std::vector<std::vector<float>>& parts) {
  std::vector<float> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// ---- kda_recurrent / kda_chunked -------------------------------------------------------------

enum class Decay { random, strong, none };

// Every input of one KDA call over several sequences, and each sequence's state before it.
struct KdaBatch {
  int64_t H = 0, K = 0, V = 0, T = 0, qk_stride = 0, v_stride = 0;
  std::vector<int32_t> lens, starts;
  std::vector<float> q, k, v, g, beta;     // [T, qk_stride], [T, qk_stride], [T, v_stride], [T, H, K], [T, H]
  std::vector<std::vector<float>> states;  // [S][H, K, V]

  std::string describe() const {
    std::string l;
    for (int32_t n : lens) l += std::to_string(n) + " ";
    return "H=" + std::to_string(H) + " K=" + std::to_string(K) + " V=" + std::to_string(V) + " lens=" + l;
  }
};

KdaBatch make_batch(int64_t H, int64_t K, int64_t V, std::vector<int32_t> lens, std::mt19937& rng,
                    Decay decay = Decay::random, float decay_value = 0.0f, bool fresh_states = false) {
  KdaBatch b;
  b.H = H, b.K = K, b.V = V;
  b.lens = std::move(lens);
  b.starts = reversed_starts(b.lens);
  b.T = std::accumulate(b.lens.begin(), b.lens.end(), int64_t{0});
  b.qk_stride = H * K + 3;
  b.v_stride = H * V + 5;
  b.q = randn(b.T * b.qk_stride, rng);
  b.k = randn(b.T * b.qk_stride, rng);
  b.v = randn(b.T * b.v_stride, rng);
  b.beta = randn(b.T * H, rng, 2.0f);
  b.g.resize(b.T * H * K);
  // Random decays span five orders of magnitude, -0.002 to -40 (-exp of a normal with mean -1.5,
  // sd 1.5), so some channels keep their state over the whole chunk and some forget it at once.
  std::normal_distribution<float> log_rate(-1.5f, 1.5f);
  for (float& x : b.g)
    x = decay == Decay::random   ? -std::min(40.0f, std::exp(log_rate(rng)))
        : decay == Decay::strong ? decay_value
                                 : 0.0f;
  for (int32_t n : b.lens) {
    (void)n;
    b.states.push_back(fresh_states ? std::vector<float>(H * K * V, 0.0f) : randn(H * K * V, rng, 0.3f));
  }
  return b;
}

// Runs `fn` over tokens [starts[s] + from[s], + count[s]) of each sequence, on `states` (updated),
// writing those tokens' rows of `out` [T, H, V].
using KdaCall = std::function<void(const KdaArgs&)>;

void run_kda(const KdaCall& fn, const KdaBatch& b, std::vector<std::vector<float>>& states,
             const std::vector<int32_t>& from, const std::vector<int32_t>& count, std::vector<float>& out,
             float* const* step_states = nullptr) {
  std::vector<int32_t> seq_start(b.lens.size());
  std::vector<float*> ptrs;
  for (size_t s = 0; s < b.lens.size(); ++s) {
    seq_start[s] = b.starts[s] + from[s];
    ptrs.push_back(states[s].data());
  }
  fn(KdaArgs{.q = b.q.data(), .k = b.k.data(), .qk_stride = b.qk_stride, .v = b.v.data(), .v_stride = b.v_stride,
             .g = b.g.data(), .beta = b.beta.data(), .num_tokens = b.T, .num_heads = b.H, .head_k = b.K,
             .head_v = b.V, .num_seqs = static_cast<int64_t>(b.lens.size()), .seq_start = seq_start.data(),
             .seq_len = count.data(), .states = ptrs.data(), .out = out.data(), .step_states = step_states});
}

struct KdaResult {
  std::vector<float> out;    // [T, H, V]
  std::vector<float> state;  // every sequence's final state, concatenated
};

// All tokens of every sequence in one call.
KdaResult run_whole(const KdaCall& fn, const KdaBatch& b) {
  KdaResult r{std::vector<float>(b.T * b.H * b.V, NAN), {}};
  auto states = b.states;
  run_kda(fn, b, states, std::vector<int32_t>(b.lens.size(), 0), b.lens, r.out);
  r.state = concat(states);
  return r;
}

// The same tokens over `calls` calls, each sequence cut at its own random points (pieces may be
// empty), the states carried from call to call.
KdaResult run_split(const KdaCall& fn, const KdaBatch& b, int calls, std::mt19937& rng) {
  KdaResult r{std::vector<float>(b.T * b.H * b.V, NAN), {}};
  auto states = b.states;
  const size_t S = b.lens.size();
  std::vector<std::vector<int32_t>> cuts(S);
  for (size_t s = 0; s < S; ++s) {
    cuts[s] = {0, b.lens[s]};
    for (int c = 1; c < calls; ++c) cuts[s].push_back(static_cast<int32_t>(rng() % (b.lens[s] + 1)));
    std::sort(cuts[s].begin(), cuts[s].end());
  }
  for (int c = 0; c < calls; ++c) {
    std::vector<int32_t> from(S), count(S);
    for (size_t s = 0; s < S; ++s) {
      from[s] = cuts[s][c];
      count[s] = cuts[s][c + 1] - cuts[s][c];
    }
    run_kda(fn, b, states, from, count, r.out);
  }
  r.state = concat(states);
  return r;
}

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

void expect_close(const KdaResult& got, const KdaResult& want, double tol, const std::string& what) {
  EXPECT_LE(normalized_error(got.out, want.out), tol) << what << " (outputs)";
  EXPECT_LE(normalized_error(got.state, want.state), tol) << what << " (states)";
}

// The definition in double, written here independently of the kernels.
KdaResult kda_by_definition(const KdaBatch& b) {
  const int64_t H = b.H, K = b.K, V = b.V;
  KdaResult r{std::vector<float>(b.T * H * V, NAN), {}};
  for (size_t s = 0; s < b.lens.size(); ++s) {
    std::vector<float> final_state(H * K * V);
    for (int64_t h = 0; h < H; ++h) {
      std::vector<std::vector<double>> S(K, std::vector<double>(V));
      for (int64_t c = 0; c < K; ++c)
        for (int64_t j = 0; j < V; ++j) S[c][j] = b.states[s][(h * K + c) * V + j];
      for (int64_t t = b.starts[s]; t < b.starts[s] + b.lens[s]; ++t) {
        const float* q = &b.q[t * b.qk_stride + h * K];
        const float* k = &b.k[t * b.qk_stride + h * K];
        double qq = 0, kk = 0;
        for (int64_t c = 0; c < K; ++c) qq += double{q[c]} * q[c], kk += double{k[c]} * k[c];
        std::vector<double> qn(K), kn(K);
        for (int64_t c = 0; c < K; ++c) {
          qn[c] = q[c] / std::sqrt(qq + 1e-6) / std::sqrt(double(K));
          kn[c] = k[c] / std::sqrt(kk + 1e-6);
        }
        const double beta = 1.0 / (1.0 + std::exp(-double{b.beta[t * H + h]}));
        for (int64_t c = 0; c < K; ++c)
          for (int64_t j = 0; j < V; ++j) S[c][j] *= std::exp(double{b.g[(t * H + h) * K + c]});
        std::vector<double> kv(V, 0.0);  // S^T k
        for (int64_t c = 0; c < K; ++c)
          for (int64_t j = 0; j < V; ++j) kv[j] += S[c][j] * kn[c];
        for (int64_t c = 0; c < K; ++c)
          for (int64_t j = 0; j < V; ++j) S[c][j] += beta * kn[c] * (b.v[t * b.v_stride + h * V + j] - kv[j]);
        for (int64_t j = 0; j < V; ++j) {
          double o = 0;
          for (int64_t c = 0; c < K; ++c) o += S[c][j] * qn[c];
          r.out[(t * H + h) * V + j] = static_cast<float>(o);
        }
      }
      for (int64_t c = 0; c < K; ++c)
        for (int64_t j = 0; j < V; ++j) final_state[(h * K + c) * V + j] = static_cast<float>(S[c][j]);
    }
    r.state.insert(r.state.end(), final_state.begin(), final_state.end());
  }
  return r;
}

TEST(KdaReference, RecurrentIsTheDefinition) {
  std::mt19937 rng(21);
  for (const auto& lens : {std::vector<int32_t>{5, 3}, std::vector<int32_t>{1}, std::vector<int32_t>{9, 0, 2}}) {
    const KdaBatch b = make_batch(2, 4, 3, lens, rng);
    expect_close(run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b), kda_by_definition(b), 1e-6,
                 b.describe());
  }
  // One token from a zero state, worked by hand: S = beta k v^T, o = beta (k . q) v, with k and q
  // normalized (q also by K^-0.5), whatever the decay.
  KdaBatch b = make_batch(1, 2, 2, {1}, rng, Decay::strong, -0.7f, /*fresh_states=*/true);
  b.q = {3, 4, 0, 0, 0};  // qk_stride 5
  b.k = {0, 2, 0, 0, 0};
  b.v = {1, -2, 0, 0, 0, 0, 0};  // v_stride 7
  b.beta = {0.0f};               // sigmoid: 1/2
  const KdaResult r = run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b);
  const double kn = 2 / std::sqrt(4 + 1e-6), qn1 = 4 / std::sqrt(25 + 1e-6) / std::sqrt(2.0);
  EXPECT_NEAR(r.out[0], 0.5 * kn * qn1 * 1, 1e-6);
  EXPECT_NEAR(r.out[1], 0.5 * kn * qn1 * -2, 1e-6);
  EXPECT_NEAR(r.state[2], 0.5 * kn * 1, 1e-6);  // S[1][0]
  EXPECT_EQ(r.state[0], 0.0f);
}

struct KdaShape {
  int64_t H, K, V;
  std::vector<int32_t> lens;
};

// Both KDA ops, every host kernel, against the reference kda_recurrent (the definition step by step).
TEST(KdaOps, EveryHostKernelMatchesReference) {
  std::mt19937 rng(22);
  const KdaShape shapes[] = {
      {12, 128, 128, {300}},            // Kimi K3 at TP 8, one long prefill
      {12, 128, 128, {1, 40, 5}},       // decode and short prefills together
      {4, 16, 16, {1, 2, 100, 33}},     // the shipped tiny models' head dim
      {3, 20, 24, {7, 65}},             // dims that are not whole vectors
      {2, 20, 100, {9, 1, 17}},         // columns past whole AVX2 tiles (32 x 3 + 4) and vectors
      {2, 32, 40, {1}},                 // T = 1
      {1, 1, 1, {3, 1}},
  };
  const KernelEntry* ref = reference_kernel(OpId::kda_recurrent);
  for (const KdaShape& s : shapes) {
    const KdaBatch b = make_batch(s.H, s.K, s.V, s.lens, rng);
    const KdaResult want = run_whole(fn_of<KdaFn>(ref), b);
    ASSERT_TRUE(all_finite(want.out) && all_finite(want.state)) << b.describe();
    const OpShape shape{.heads_per_rank = s.H, .head_dim = s.K};
    for (OpId op : {OpId::kda_recurrent, OpId::kda_chunked})
      for (const KernelEntry* k : host_kernels(op, shape)) {
        const KdaResult got = run_whole(fn_of<KdaFn>(k), b);
        expect_close(got, want, kExact, k->name + " " + b.describe());
      }
  }
}

// Lengths C - 1, C, C + 1 and 2C + 3 for the chunk sizes C of the chunked kernels: cpu 8, cuda 16,
// reference 64.
TEST(KdaChunked, MatchesRecurrentAtChunkBoundaries) {
  std::mt19937 rng(23);
  const KdaBatch b = make_batch(2, 32, 32, {1, 7, 8, 9, 19, 15, 16, 17, 35, 63, 64, 65, 131}, rng);
  const KdaResult want = run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b);
  for (const KernelEntry* k : host_kernels(OpId::kda_chunked, OpShape{.heads_per_rank = 2, .head_dim = 32}))
    expect_close(run_whole(fn_of<KdaFn>(k), b), want, kExact, k->name);
}

// A sequence split over several calls at arbitrary points (chunks then start mid-sequence, and
// some calls give a sequence no tokens) gives what one call gives.
TEST(KdaChunked, SplitOverCallsEqualsOneCall) {
  std::mt19937 rng(24);
  for (const KdaShape& s : {KdaShape{2, 32, 32, {300, 77, 1}}, KdaShape{12, 128, 128, {150, 19}}}) {
    const KdaBatch b = make_batch(s.H, s.K, s.V, s.lens, rng);
    const KdaResult want = run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b);
    for (OpId op : {OpId::kda_chunked, OpId::kda_recurrent})
      for (const KernelEntry* k : host_kernels(op, OpShape{.heads_per_rank = s.H, .head_dim = s.K}))
        for (int calls : {2, 5}) {
          const KdaResult got = run_split(fn_of<KdaFn>(k), b, calls, rng);
          expect_close(got, want, kExact, k->name + " in " + std::to_string(calls) + " calls, " + b.describe());
          expect_close(got, run_whole(fn_of<KdaFn>(k), b), kExact, k->name + " split vs whole");
        }
  }
}

// g = -5 per token (Kimi K3's lower bound) for 200 tokens: exp(-G) reaches exp(1000); and -60
// (Kimi Linear's decay is unbounded). No decay at all: g = 0.
TEST(KdaChunked, StrongDecayAndNoDecay) {
  std::mt19937 rng(25);
  for (float gv : {-5.0f, -60.0f, 0.0f}) {
    const KdaBatch b = make_batch(4, 64, 64, {200, 3}, rng, Decay::strong, gv);
    const KdaResult want = run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b);
    ASSERT_TRUE(all_finite(want.out) && all_finite(want.state)) << gv;
    for (OpId op : {OpId::kda_chunked, OpId::kda_recurrent})
      for (const KernelEntry* k : host_kernels(op, OpShape{.heads_per_rank = 4, .head_dim = 64})) {
        const KdaResult got = run_whole(fn_of<KdaFn>(k), b);
        EXPECT_TRUE(all_finite(got.out) && all_finite(got.state)) << k->name << " g=" << gv;
        expect_close(got, want, kExact, k->name + " g=" + std::to_string(gv));
      }
  }
}

// ---- short_conv --------------------------------------------------------------------------------

struct ConvBatch {
  int64_t C = 0, W = 0, T = 0, x_stride = 0, y_stride = 0;
  std::vector<int32_t> lens, starts;
  std::vector<float> x, weight;            // [T, x_stride], [C, W]
  std::vector<std::vector<float>> states;  // [S][W-1, C]
};

ConvBatch make_conv(int64_t C, int64_t W, std::vector<int32_t> lens, std::mt19937& rng, bool fresh_states) {
  ConvBatch b;
  b.C = C, b.W = W;
  b.lens = std::move(lens);
  b.starts = reversed_starts(b.lens);
  b.T = std::accumulate(b.lens.begin(), b.lens.end(), int64_t{0});
  b.x_stride = C + 3;
  b.y_stride = C + 1;
  b.x = randn(b.T * b.x_stride, rng, 2.0f);
  b.weight = randn(C * W, rng, 0.5f);
  for (size_t s = 0; s < b.lens.size(); ++s)
    b.states.push_back(fresh_states ? std::vector<float>((W - 1) * C, 0.0f) : randn((W - 1) * C, rng, 2.0f));
  return b;
}

struct ConvResult {
  std::vector<float> y, state;
};

// Tokens [from, from + count) of each sequence per call, `calls` of them in turn; count = 0
// everywhere means one call with all tokens (the only use of step_states).
ConvResult run_conv(const std::function<void(const ShortConvArgs&)>& fn, const ConvBatch& b,
                    int64_t tokens_per_call = 0, float* const* step_states = nullptr) {
  ConvResult r{std::vector<float>(b.T * b.y_stride, NAN), {}};
  auto states = b.states;
  std::vector<float*> ptrs;
  for (auto& s : states) ptrs.push_back(s.data());
  const int32_t longest = *std::max_element(b.lens.begin(), b.lens.end());
  const int64_t step = tokens_per_call > 0 ? tokens_per_call : std::max<int64_t>(1, longest);
  for (int64_t from = 0; from < std::max<int32_t>(longest, 1); from += step) {
    std::vector<int32_t> start(b.lens.size()), count(b.lens.size());
    for (size_t s = 0; s < b.lens.size(); ++s) {
      start[s] = b.starts[s] + static_cast<int32_t>(std::min<int64_t>(from, b.lens[s]));
      count[s] = static_cast<int32_t>(std::clamp<int64_t>(b.lens[s] - from, 0, step));
    }
    fn(ShortConvArgs{.x = b.x.data(), .x_stride = b.x_stride, .num_tokens = b.T, .channels = b.C, .width = b.W,
                     .weight = b.weight.data(), .num_seqs = static_cast<int64_t>(b.lens.size()),
                     .seq_start = start.data(), .seq_len = count.data(), .states = ptrs.data(), .y = r.y.data(),
                     .y_stride = b.y_stride, .step_states = step_states});
  }
  r.state = concat(states);
  return r;
}

// NaN rows of y between the written ones (the stride's padding) do not count.
std::vector<float> written(const ConvBatch& b, const std::vector<float>& y) {
  std::vector<float> out;
  for (int64_t t = 0; t < b.T; ++t) out.insert(out.end(), &y[t * b.y_stride], &y[t * b.y_stride] + b.C);
  return out;
}

TEST(KdaShortConv, EveryHostKernelMatchesReference) {
  std::mt19937 rng(26);
  for (int64_t C : {1, 17, 64, 300})
    for (int64_t W : {1, 2, 4})
      for (const std::vector<int32_t>& lens : {std::vector<int32_t>{1, 2, 7, 40}, {1}, {0, 5}}) {
        const ConvBatch b = make_conv(C, W, lens, rng, false);
        const ConvResult want = run_conv(fn_of<ShortConvFn>(reference_kernel(OpId::short_conv)), b);
        for (const KernelEntry* k : host_kernels(OpId::short_conv, {})) {
          const ConvResult got = run_conv(fn_of<ShortConvFn>(k), b);
          EXPECT_LE(normalized_error(written(b, got.y), written(b, want.y)), kExact)
              << k->name << " C=" << C << " W=" << W;
          EXPECT_EQ(got.state, want.state) << k->name << " C=" << C << " W=" << W;  // copies of inputs
        }
      }
}

// Decode (one token per call) continues exactly where one prefill call would be.
TEST(KdaShortConv, TokenByTokenEqualsOneCall) {
  std::mt19937 rng(27);
  for (int64_t W : {2, 4}) {
    const ConvBatch b = make_conv(48, W, {1, 2, 3, 20}, rng, false);
    for (const KernelEntry* k : host_kernels(OpId::short_conv, {}))
      for (int64_t per_call : {1, 2, 7}) {
        const ConvResult whole = run_conv(fn_of<ShortConvFn>(k), b);
        const ConvResult split = run_conv(fn_of<ShortConvFn>(k), b, per_call);
        EXPECT_EQ(written(b, split.y), written(b, whole.y)) << k->name << " W=" << W << " per call " << per_call;
        EXPECT_EQ(split.state, whole.state) << k->name << " W=" << W << " per call " << per_call;
      }
  }
}

// From a fresh (zero) state the op is a causal conv with zero padding, then SiLU.
TEST(KdaShortConv, FreshStateIsZeroPadding) {
  std::mt19937 rng(28);
  const ConvBatch b = make_conv(33, 4, {1, 3, 10}, rng, true);
  std::vector<float> want(b.T * b.C);
  for (size_t s = 0; s < b.lens.size(); ++s)
    for (int64_t i = 0; i < b.lens[s]; ++i)
      for (int64_t c = 0; c < b.C; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < b.W; ++j) {
          const int64_t p = i - (b.W - 1) + j;
          if (p >= 0) acc += double{b.weight[c * b.W + j]} * b.x[(b.starts[s] + p) * b.x_stride + c];
        }
        want[(b.starts[s] + i) * b.C + c] = static_cast<float>(acc / (1 + std::exp(-acc)));
      }
  for (const KernelEntry* k : host_kernels(OpId::short_conv, {})) {
    const ConvResult got = run_conv(fn_of<ShortConvFn>(k), b);
    EXPECT_LE(normalized_error(written(b, got.y), want), kExact) << k->name;
  }
}

// ---- step states (speculative verification) ----------------------------------------------------
// A hybrid model verifying a proposal asks short_conv and kda_recurrent for the state after each
// token, to restore the one at the accepted position. Step state i of a sequence must be exactly
// the final state of the op run on the sequence's first i + 1 tokens alone, and asking for step
// states must change neither the outputs nor the final states.

// Lengths 1..9 in one call (and an empty sequence, which gets no step states).
const std::vector<int32_t> kStepLens = {3, 1, 9, 5, 0, 2, 8, 4, 7, 6};

// Per-sequence step state buffers of `per_token` floats a token, NaN until written.
struct StepBuffers {
  std::vector<std::vector<float>> each;
  std::vector<float*> ptrs;
  StepBuffers(const std::vector<int32_t>& lens, int64_t per_token) {
    for (int32_t n : lens) each.emplace_back(static_cast<size_t>(n * per_token), NAN);
    for (auto& e : each) ptrs.push_back(e.data());
  }
};

// Where n floats at got and want first differ, or "" when they are identical (NaN never is).
std::string first_difference(const float* got, const float* want, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!(got[i] == want[i]))
      return "element " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want[i]);
  return "";
}

// The final state of sequence s after its first n tokens, run alone (one sequence, one call).
std::vector<float> kda_prefix_state(const KdaCall& fn, const KdaBatch& b, size_t s, int32_t n) {
  std::vector<float> state = b.states[s], out(b.T * b.H * b.V, NAN);
  float* ptr = state.data();
  const int32_t start = b.starts[s];
  fn(KdaArgs{.q = b.q.data(), .k = b.k.data(), .qk_stride = b.qk_stride, .v = b.v.data(), .v_stride = b.v_stride,
             .g = b.g.data(), .beta = b.beta.data(), .num_tokens = b.T, .num_heads = b.H, .head_k = b.K,
             .head_v = b.V, .num_seqs = 1, .seq_start = &start, .seq_len = &n, .states = &ptr, .out = out.data()});
  return state;
}

TEST(KdaRecurrent, StepStatesArePrefixFinalStates) {
  std::mt19937 rng(32);
  const KdaShape shapes[] = {
      {3, 20, 24, kStepLens},       // dims that are not whole vectors
      {2, 16, 200, {1, 9, 5}},      // two column tiles on cpu (128 + 72), seven column blocks on cuda
      {2, 12, 36, {1, 9, 5}},       // a partial last vector on AVX-512 and AVX2
      {12, 128, 128, {9, 1, 4}},    // Kimi K3 at TP 8
  };
  const KernelEntry* ref = reference_kernel(OpId::kda_recurrent);
  for (const KdaShape& sh : shapes) {
    const KdaBatch b = make_batch(sh.H, sh.K, sh.V, sh.lens, rng);
    const int64_t HKV = b.H * b.K * b.V;
    const std::vector<int32_t> zeros(b.lens.size(), 0);
    StepBuffers ref_steps(b.lens, HKV);
    {
      auto states = b.states;
      std::vector<float> out(b.T * b.H * b.V, NAN);
      run_kda(fn_of<KdaFn>(ref), b, states, zeros, b.lens, out, ref_steps.ptrs.data());
    }
    for (const KernelEntry* k : host_kernels(OpId::kda_recurrent, OpShape{.heads_per_rank = sh.H, .head_dim = sh.K})) {
      const KdaFn fn = fn_of<KdaFn>(k);
      const std::string what = k->name + " " + b.describe();
      const KdaResult plain = run_whole(fn, b);
      StepBuffers steps(b.lens, HKV);
      KdaResult with{std::vector<float>(b.T * b.H * b.V, NAN), {}};
      auto states = b.states;
      run_kda(fn, b, states, zeros, b.lens, with.out, steps.ptrs.data());
      with.state = concat(states);
      const auto n_out = static_cast<int64_t>(plain.out.size()), n_state = static_cast<int64_t>(plain.state.size());
      EXPECT_EQ(first_difference(with.out.data(), plain.out.data(), n_out), "") << what << " (outputs)";
      EXPECT_EQ(first_difference(with.state.data(), plain.state.data(), n_state), "") << what << " (final states)";
      for (size_t s = 0; s < b.lens.size(); ++s) {
        for (int32_t i = 0; i < b.lens[s]; ++i)
          EXPECT_EQ(first_difference(&steps.each[s][i * HKV], kda_prefix_state(fn, b, s, i + 1).data(), HKV), "")
              << what << " sequence " << s << " step " << i;
        EXPECT_LE(normalized_error(steps.each[s], ref_steps.each[s]), kExact) << what << " sequence " << s;
      }
    }
  }
}

// The final state of conv sequence s after its first n tokens, run alone.
std::vector<float> conv_prefix_state(ShortConvFn fn, const ConvBatch& b, size_t s, int32_t n) {
  std::vector<float> state = b.states[s], y(b.T * b.y_stride, NAN);
  float* ptr = state.data();
  const int32_t start = b.starts[s];
  fn(ShortConvArgs{.x = b.x.data(), .x_stride = b.x_stride, .num_tokens = b.T, .channels = b.C, .width = b.W,
                   .weight = b.weight.data(), .num_seqs = 1, .seq_start = &start, .seq_len = &n, .states = &ptr,
                   .y = y.data(), .y_stride = b.y_stride});
  return state;
}

TEST(KdaShortConv, StepStatesArePrefixFinalStates) {
  std::mt19937 rng(33);
  for (int64_t C : {17, 300})
    for (int64_t W : {1, 2, 4}) {
      const ConvBatch b = make_conv(C, W, kStepLens, rng, false);
      const int64_t per_token = (W - 1) * C;
      for (const KernelEntry* k : host_kernels(OpId::short_conv, {})) {
        const ShortConvFn fn = fn_of<ShortConvFn>(k);
        const std::string what = k->name + " C=" + std::to_string(C) + " W=" + std::to_string(W);
        const ConvResult plain = run_conv(fn, b);
        StepBuffers steps(b.lens, per_token);
        const ConvResult with = run_conv(fn, b, 0, steps.ptrs.data());
        EXPECT_EQ(written(b, with.y), written(b, plain.y)) << what;
        EXPECT_EQ(with.state, plain.state) << what;
        for (size_t s = 0; s < b.lens.size(); ++s)
          for (int32_t i = 0; i < b.lens[s]; ++i)
            EXPECT_EQ(first_difference(steps.each[s].data() + i * per_token, conv_prefix_state(fn, b, s, i + 1).data(),
                                       per_token),
                      "")
                << what << " sequence " << s << " step " << i;
      }
    }
}

// kda_chunked does not write step states (the model asks for them through kda_recurrent only):
// a caller that passes them anyway stops with a message instead of getting stale buffers.
TEST(KdaChunkedDeathTest, RefusesStepStates) {
  std::mt19937 rng(34);
  const KdaBatch b = make_batch(2, 16, 16, {3, 2}, rng);
  for (const KernelEntry* k : host_kernels(OpId::kda_chunked, OpShape{.heads_per_rank = 2, .head_dim = 16})) {
    StepBuffers steps(b.lens, b.H * b.K * b.V);
    auto states = b.states;
    std::vector<float> out(b.T * b.H * b.V);
    EXPECT_DEATH(run_kda(fn_of<KdaFn>(k), b, states, std::vector<int32_t>(b.lens.size(), 0), b.lens, out,
                         steps.ptrs.data()),
                 "step_states")
        << k->name;
  }
}

// ---- kda_gate, gated_rms_norm ------------------------------------------------------------------

TEST(KdaGate, BothFormsMatchTheFormula) {
  std::mt19937 rng(29);
  for (float lower_bound : {0.0f, -5.0f})
    for (auto [T, H, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {3, 12, 128}, {5, 4, 20}}) {
      auto raw = randn(T * H * K, rng, 8.0f);  // past softplus's threshold of 20 at the tails
      raw[0] = 30.0f;
      if (raw.size() > 1) raw[1] = -30.0f;
      const auto dt_bias = randn(H * K, rng), a_log = randn(H, rng, 1.0f);
      std::vector<float> want(raw.size());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t k = 0; k < K; ++k) {
            const int64_t i = (t * H + h) * K + k;
            const double x = double{raw[i]} + dt_bias[h * K + k], A = std::exp(double{a_log[h]});
            const double softplus = x > 20 ? x : std::log(1 + std::exp(x));
            want[i] = static_cast<float>(lower_bound < 0 ? lower_bound / (1 + std::exp(-A * x)) : -A * softplus);
          }
      for (const KernelEntry* k : host_kernels(OpId::kda_gate, {}))
        for (bool in_place : {false, true}) {
          std::vector<float> g = in_place ? raw : std::vector<float>(raw.size(), NAN);
          fn_of<KdaGateFn>(k)(KdaGateArgs{.raw = in_place ? g.data() : raw.data(), .num_tokens = T, .num_heads = H,
                                          .head_dim = K, .a_log = a_log.data(), .dt_bias = dt_bias.data(),
                                          .lower_bound = lower_bound, .g = g.data()});
          EXPECT_LE(normalized_error(g, want), kExact) << k->name << " lb=" << lower_bound << " K=" << K;
          EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return v <= 0.0f && std::isfinite(v); }))
              << k->name;
        }
    }
}

TEST(KdaGatedRmsNorm, MatchesTheFormula) {
  std::mt19937 rng(30);
  for (auto [T, H, D] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {3, 12, 128}, {17, 3, 100}, {2, 4, 16}}) {
    const auto x = randn(T * H * D, rng, 3.0f), gate = randn(T * H * D, rng, 3.0f), w = randn(D, rng);
    const float eps = 1e-5f;
    std::vector<float> want(x.size());
    for (int64_t r = 0; r < T * H; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < D; ++d) ss += double{x[r * D + d]} * x[r * D + d];
      for (int64_t d = 0; d < D; ++d)
        want[r * D + d] = static_cast<float>(x[r * D + d] / std::sqrt(ss / D + eps) * w[d] /
                                             (1 + std::exp(-double{gate[r * D + d]})));
    }
    for (const KernelEntry* k : host_kernels(OpId::gated_rms_norm, {}))
      for (bool in_place : {false, true}) {
        std::vector<float> y = in_place ? x : std::vector<float>(x.size(), NAN);
        fn_of<GatedRmsNormFn>(k)(GatedRmsNormArgs{.x = in_place ? y.data() : x.data(), .gate = gate.data(),
                                                  .weight = w.data(), .num_tokens = T, .num_heads = H,
                                                  .head_dim = D, .eps = eps, .y = y.data()});
        EXPECT_LE(normalized_error(y, want), kExact) << k->name << " D=" << D << " in place " << in_place;
      }
  }
}

// ---- registry and dispatch ---------------------------------------------------------------------

const OpId kKdaOps[] = {OpId::short_conv, OpId::kda_gate, OpId::kda_recurrent, OpId::kda_chunked, OpId::gated_rms_norm};

ModelOpNeeds needs_with_kda(int64_t kda_heads, int64_t kda_dim) {
  return ModelOpNeeds{.matmul_dtypes = {DType::BF16}, .heads_per_rank = 16, .attention_head_dim = 576,
                      .kda_heads_per_rank = kda_heads, .kda_head_dim = kda_dim};
}

TEST(KdaRegistry, ResolvedOnlyForModelsWithKdaLayers) {
  for (Backend b : reg().compiled_backends()) {
    for (const ResolvedOp& r : OpTable::plan(b, needs_with_kda(0, 0)))
      for (OpId op : kKdaOps) EXPECT_NE(r.op, op) << op_name(op) << " resolved for a model without KDA layers";
  }
  // Kimi K3 (96 heads: 12 per rank at TP 8), Kimi Linear (32 heads), the tiny models (16, 32)
  for (auto [heads, dim] : {std::pair<int64_t, int64_t>{12, 128}, {96, 128}, {32, 128}, {4, 16}, {2, 32}})
    for (Backend b : reg().compiled_backends()) {
      const auto plan = OpTable::plan(b, needs_with_kda(heads, dim));
      for (OpId op : kKdaOps) {
        auto it = std::find_if(plan.begin(), plan.end(), [&](const ResolvedOp& r) { return r.op == op; });
        ASSERT_NE(it, plan.end()) << op_name(op);
        EXPECT_TRUE(it->resolution.usable())
            << it->use << " on " << backend_name(b) << ": " << it->resolution.describe();
        EXPECT_NE(it->use.find("heads/rank=" + std::to_string(heads)), std::string::npos) << it->use;
        // The real shapes get a SIMD kernel wherever the CPU has AVX-512 or AVX2.
        if (b == Backend::cpu && (cpu_has_isa("avx512") || cpu_has_isa("avx2"))) {
          EXPECT_EQ(it->resolution.kind, Resolution::Kind::kernel) << it->use;
          EXPECT_EQ(it->resolution.kernel->backend, Backend::cpu) << it->use;
        }
      }
    }
}

// Through the op table, as the model calls them.
TEST(KdaRegistry, OpTableRunsTheResolvedKernels) {
  auto table = OpTable::resolve(Backend::cpu, needs_with_kda(3, 16));
  ASSERT_TRUE(table.ok()) << table.error().message;
  const OpTable& ops = *table;
  std::mt19937 rng(31);
  const KdaBatch b = make_batch(3, 16, 16, {5, 20}, rng);
  const KdaResult want = run_whole(fn_of<KdaFn>(reference_kernel(OpId::kda_recurrent)), b);
  expect_close(run_whole([&](const KdaArgs& a) { ops.kda_recurrent(a); }, b), want, kExact, "table kda_recurrent");
  expect_close(run_whole([&](const KdaArgs& a) { ops.kda_chunked(a); }, b), want, kExact, "table kda_chunked");

  const ConvBatch cb = make_conv(48, 4, {5, 20}, rng, false);
  const ConvResult conv_want = run_conv(fn_of<ShortConvFn>(reference_kernel(OpId::short_conv)), cb);
  const ConvResult conv = run_conv([&](const ShortConvArgs& a) { ops.short_conv(a); }, cb);
  EXPECT_LE(normalized_error(written(cb, conv.y), written(cb, conv_want.y)), kExact);
  EXPECT_EQ(conv.state, conv_want.state);

  const int64_t T = 4, H = 3, D = 16;
  const auto raw = randn(T * H * D, rng, 3.0f), dt_bias = randn(H * D, rng), a_log = randn(H, rng);
  std::vector<float> g(raw.size()), g_want(raw.size());
  KdaGateArgs ga{.raw = raw.data(), .num_tokens = T, .num_heads = H, .head_dim = D, .a_log = a_log.data(),
                 .dt_bias = dt_bias.data(), .lower_bound = -5.0f, .g = g_want.data()};
  fn_of<KdaGateFn>(reference_kernel(OpId::kda_gate))(ga);
  ga.g = g.data();
  ops.kda_gate(ga);
  EXPECT_LE(normalized_error(g, g_want), kExact);

  const auto w = randn(D, rng);
  std::vector<float> y(raw.size()), y_want(raw.size());
  GatedRmsNormArgs na{.x = raw.data(), .gate = g.data(), .weight = w.data(), .num_tokens = T, .num_heads = H,
                      .head_dim = D, .eps = 1e-6f, .y = y_want.data()};
  fn_of<GatedRmsNormFn>(reference_kernel(OpId::gated_rms_norm))(na);
  na.y = y.data();
  ops.gated_rms_norm(na);
  EXPECT_LE(normalized_error(y, y_want), kExact);
}

}  // namespace
}  // namespace moat::ops
