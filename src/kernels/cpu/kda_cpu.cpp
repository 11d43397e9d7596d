// CPU kernels of the Kimi Delta Attention ops (kernel_types.h: short_conv, kda_gate,
// kda_recurrent, kda_chunked, gated_rms_norm), AVX-512 intrinsics under a target pragma and
// registered with cpu_isa "avx512", so one binary runs anywhere: a CPU without AVX-512 resolves
// these ops to the reference kernels (their declared fallback). Any head dim: head vectors are
// zero-padded to whole vectors in scratch, state columns are taken 16 at a time with a mask.
//
// Both KDA kernels split the pool over (sequence, head) pairs and walk the state [K, V] in
// column tiles: the columns of S evolve independently (S[:, v] only meets v[v] and u[v]), so a
// tile is all a step touches. kda_recurrent takes up to 128 columns (whole rows at V = 128: one
// decode token streams the state in order), kda_chunked 16 (K rows of 64 bytes) against the
// chunk's coefficients. kda_recurrent's step states (speculative verification) are stored by the
// pass that writes the state, in an instantiation of its own; kda_chunked refuses them.
//
// Numerics: fp32 throughout, the reference sums in double; tests/ops/kda_ops_test.cpp bounds the
// normalized error.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

// GCC 12's intrinsics headers start some conversions from an _mm*_undefined value: false positives.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include "kernels/cpu/avx512_helpers.h"

namespace moat::ops {
namespace {

constexpr int64_t kW = 16;  // floats per vector

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline __mmask16 tail_mask(int64_t n) {
  return n >= kW ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline __m512 splat(float s) { return _mm512_set1_ps(s); }

// f(0), ..., f(N-1) with compile-time indices, so arrays of vector accumulators indexed by them
// become registers (a `#pragma GCC unroll` loop is unrolled too late for that: GCC then stores
// every accumulator to the stack on every iteration).
template <int N, typename F>
inline void unroll(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

inline float hsum(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return _mm_cvtss_f32(s4);
}

using avx512::vexp;

// log(x) for normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log(m) = f - f^2/2 + f^3 P(f)
// with f = m - 1 (Cephes logf's polynomial), ln 2 split in two so e ln2 adds exactly.
inline __m512 vlog(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, splat(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, splat(0.5f));
  e = _mm512_mask_add_ps(e, big, e, splat(1.0f));
  const __m512 f = _mm512_sub_ps(m, splat(1.0f));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = splat(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, f, splat(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, f, splat(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, f, splat(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, f, splat(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, f, splat(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, f, splat(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, f, splat(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, f, splat(3.3333331174e-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
  y = _mm512_fmadd_ps(e, splat(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, splat(0.5f), y);
  return _mm512_fmadd_ps(e, splat(0.693359375f), _mm512_add_ps(f, y));
}

inline __m512 vsigmoid(__m512 x) {
  return _mm512_div_ps(splat(1.0f), _mm512_add_ps(splat(1.0f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// torch's softplus (threshold 20), evaluated as max(x, 0) + log1p(exp(-|x|)); log1p(y) as
// log(1 + y) * y / ((1 + y) - 1), exact to rounding even where 1 + y rounds to 1.
inline __m512 vsoftplus(__m512 x) {
  const __m512 y = vexp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // (0, 1]
  const __m512 u = _mm512_add_ps(splat(1.0f), y);
  const __m512 d = _mm512_sub_ps(u, splat(1.0f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_EQ_OQ);
  __m512 l1p = _mm512_mul_ps(vlog(u), _mm512_div_ps(y, _mm512_mask_blend_ps(tiny, d, splat(1.0f))));
  l1p = _mm512_mask_blend_ps(tiny, l1p, y);
  const __m512 sp = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), l1p);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, splat(20.0f), _CMP_GT_OQ), sp, x);
}

// ---- short_conv --------------------------------------------------------------------------------

constexpr int64_t kConvChannels = 256;  // channels per task: 16 vectors

void short_conv_avx512(const ShortConvArgs& a) {
  const int64_t C = a.channels, W = a.width;
  MOAT_CHECK(W >= 1, "short_conv: width {} < 1", W);
  // The weights transposed to [W, C], so each tap is a vector over channels.
  thread_local std::vector<float> wt_storage;
  std::vector<float>& wt = wt_storage;  // the caller's: pool workers reach it through this reference
  wt.resize(static_cast<size_t>(W * C));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < W; ++j) wt[j * C + c] = a.weight[c * W + j];
  const int64_t blocks = (C + kConvChannels - 1) / kConvChannels;
  thread_pool().parallel_for(a.num_seqs * blocks, [&](int64_t i0, int64_t i1) {
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t s = task / blocks, c0 = task % blocks * kConvChannels;
      const int64_t c1 = std::min(C, c0 + kConvChannels);
      const int64_t start = a.seq_start[s], L = a.seq_len[s];
      float* state = a.states[s];  // [W-1, C]
      // Row of input p of this call's part of the sequence; p < 0 are the state's rows.
      auto input = [&](int64_t p) -> const float* {
        return p >= 0 ? a.x + (start + p) * a.x_stride : state + (W - 1 + p) * C;
      };
      for (int64_t i = 0; i < L; ++i) {
        float* y = a.y + (start + i) * a.y_stride;
        for (int64_t c = c0; c < c1; c += kW) {
          const __mmask16 m = tail_mask(c1 - c);
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < W; ++j)
            acc = _mm512_fmadd_ps(load(&wt[j * C + c], m), load(input(i - (W - 1) + j) + c, m), acc);
          store(y + c, _mm512_mul_ps(acc, vsigmoid(acc)), m);
        }
      }
      // Step states (speculative verification): after token i, inputs i + 1 - (W-1) .. i, read
      // while the state still holds the call's first inputs.
      if (a.step_states != nullptr)
        for (int64_t i = 0; i < L; ++i) {
          float* step = a.step_states[s] + i * (W - 1) * C;  // [W-1, C]
          for (int64_t r = 0; r < W - 1; ++r)
            std::memcpy(step + r * C + c0, input(i + 1 - (W - 1) + r) + c0, sizeof(float) * (c1 - c0));
        }
      // The last W-1 inputs, in place: row r takes input L - (W-1) + r, which is either in x or
      // state row r + L, not yet overwritten (rows are written in increasing order).
      for (int64_t r = 0; r < W - 1 && L > 0; ++r)
        std::memcpy(state + r * C + c0, input(L - (W - 1) + r) + c0, sizeof(float) * (c1 - c0));
    }
  });
}

// ---- kda_gate, gated_rms_norm ------------------------------------------------------------------

void kda_gate_avx512(const KdaGateArgs& a) {
  const int64_t H = a.num_heads, K = a.head_dim;
  thread_pool().parallel_for(a.num_tokens * H, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t h = row % H;
      const __m512 A = splat(std::exp(a.a_log[h]));
      const float* raw = a.raw + row * K;
      const float* bias = a.dt_bias + h * K;
      float* g = a.g + row * K;
      for (int64_t k = 0; k < K; k += kW) {
        const __mmask16 m = tail_mask(K - k);
        const __m512 x = _mm512_add_ps(load(raw + k, m), load(bias + k, m));
        const __m512 out = a.lower_bound < 0.0f
                               ? _mm512_mul_ps(splat(a.lower_bound), vsigmoid(_mm512_mul_ps(A, x)))
                               : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(A, vsoftplus(x)));
        store(g + k, out, m);
      }
    }
  }, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)));
}

void gated_rms_norm_avx512(const GatedRmsNormArgs& a) {
  const int64_t D = a.head_dim;
  thread_pool().parallel_for(a.num_tokens * a.num_heads, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* x = a.x + row * D;
      const float* gate = a.gate + row * D;
      float* y = a.y + row * D;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += kW) {
        const __m512 v = load(x + d, tail_mask(D - d));
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = splat(1.0f / std::sqrt(hsum(ss) / static_cast<float>(D) + a.eps));
      for (int64_t d = 0; d < D; d += kW) {
        const __mmask16 m = tail_mask(D - d);
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load(x + d, m), inv), load(a.weight + d, m));
        store(y + d, _mm512_mul_ps(v, vsigmoid(load(gate + d, m))), m);
      }
    }
  }, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, D)));
}

// ---- KDA: per-token inputs ---------------------------------------------------------------------

// x[0, K) / sqrt(sum x^2 + 1e-6) * scale into dst[0, Kp), zeros past K.
inline void l2_normalized(const float* x, int64_t K, float scale, float* dst) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t c = 0; c < K; c += kW) {
    const __m512 v = load(x + c, tail_mask(K - c));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = splat(scale / std::sqrt(hsum(ss) + 1e-6f));
  for (int64_t c = 0; c < K; c += kW) store(dst + c, _mm512_mul_ps(load(x + c, tail_mask(K - c)), inv));
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline void prefetch_span(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += kW) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// Starts loading head h's rows of tokens [t0, t1) (q, k, g, v). Each is a few hundred bytes a
// whole token row apart, a stride the hardware prefetchers miss; a (sequence, head) task walks
// them token by token.
void prefetch_tokens(const KdaArgs& a, int64_t h, int64_t t0, int64_t t1) {
  const int64_t K = a.head_k, V = a.head_v;
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_span(a.q + t * a.qk_stride + h * K, K);
    prefetch_span(a.k + t * a.qk_stride + h * K, K);
    prefetch_span(a.g + (t * a.num_heads + h) * K, K);
    prefetch_span(a.v + t * a.v_stride + h * V, V);
  }
}

// Rows of one (sequence, head) pair's tokens, zero-padded to Kp: normalized q and k, exp(g), and
// k exp(g). Grow-only scratch: fill() writes every entry of a row.
struct KdaRows {
  int64_t Kp = 0;
  std::vector<float> q, k, decay, kdecay, beta;
  void reserve(int64_t rows, int64_t kp) {
    Kp = kp;
    for (auto* v : {&q, &k, &decay, &kdecay})
      if (v->size() < static_cast<size_t>(rows * kp)) v->resize(static_cast<size_t>(rows * kp));
    if (beta.size() < static_cast<size_t>(rows)) beta.resize(static_cast<size_t>(rows));
  }
  // Token t of the call into row i.
  void fill(const KdaArgs& a, int64_t h, int64_t t, int64_t i) {
    const int64_t K = a.head_k;
    float* kr = &k[i * Kp];
    l2_normalized(a.q + t * a.qk_stride + h * K, K, 1.0f / std::sqrt(static_cast<float>(K)), &q[i * Kp]);
    l2_normalized(a.k + t * a.qk_stride + h * K, K, 1.0f, kr);
    const float* g = a.g + (t * a.num_heads + h) * K;
    for (int64_t c = 0; c < Kp; c += kW) {  // exp(0) = 1 past K
      const __m512 d = vexp(load(g + c, tail_mask(K - c)));
      store(&decay[i * Kp + c], d);
      store(&kdecay[i * Kp + c], _mm512_mul_ps(d, load(kr + c)));
    }
    beta[i] = sigmoid(a.beta[t * a.num_heads + h]);
  }
};

// ---- kda_recurrent: step by step, a column tile of the state at a time ---------------------------

constexpr int64_t kStepBlock = 32;  // tokens prepared at once (scratch); each tile runs them all
// State columns per tile, in vectors of 16: up to 128, whole rows at V = 128, so one token
// (decode) streams the state from memory in order, and each broadcast of k, q, exp(g) serves 8
// vectors. Blocks of tokens run through the 64 KiB tile from L2: measured faster than 32-column
// tiles that stay in L1 (23 against 32 us per token, 12 heads, 1 thread).
constexpr int kTileVecs = 8;

// Tokens [0, n) of `rows` through state columns [v0, v0 + 16 NV) of one head (masks m[NV]):
//   kv = S^T (k exp(g)) (the decay folded in), u = beta (v - kv), S <- exp(g) S + k u^T, o = S^T q
// Two passes over the tile per token; with V = 128 a tile is whole state rows, so one token
// (decode) streams the state from memory once, in order, and writes it once. kSteps: the tile
// after token i is also stored at step + i H K V (step_states, this head's state of token 0), a
// compile-time choice so the ordinary path has no extra branch in its inner loop.
template <int NV, bool kSteps>
void recurrent_tile(const KdaRows& rows, int64_t n, const KdaArgs& a, int64_t h, int64_t t0, float* S, float* step,
                    int64_t v0, const __mmask16* m) {
  const int64_t K = a.head_k, V = a.head_v, Kp = rows.Kp;
  [[maybe_unused]] const int64_t step_stride = a.num_heads * K * V;  // one token's step state to the next
  for (int64_t i = 0; i < n; ++i) {
    const float* k = &rows.k[i * Kp];
    const float* q = &rows.q[i * Kp];
    const float* d = &rows.decay[i * Kp];
    const float* kd = &rows.kdecay[i * Kp];
    __m512 kv[NV], o[NV], u[NV];
    unroll<NV>([&](auto j) { kv[j] = o[j] = _mm512_setzero_ps(); });
    for (int64_t c = 0; c < K; ++c) {
      const __m512 f = splat(kd[c]);
      const float* row = S + c * V + v0;
      unroll<NV>([&](auto j) { kv[j] = _mm512_fmadd_ps(f, load(row + j * kW, m[j]), kv[j]); });
    }
    const int64_t t = t0 + i;
    const float* v = a.v + t * a.v_stride + h * V + v0;
    const __m512 beta = splat(rows.beta[i]);
    unroll<NV>([&](auto j) { u[j] = _mm512_mul_ps(beta, _mm512_sub_ps(load(v + j * kW, m[j]), kv[j])); });
    for (int64_t c = 0; c < K; ++c) {
      const __m512 dc = splat(d[c]), kc = splat(k[c]), qc = splat(q[c]);
      float* row = S + c * V + v0;
      [[maybe_unused]] float* step_row = kSteps ? step + i * step_stride + c * V + v0 : nullptr;
      unroll<NV>([&](auto j) {
        const __m512 s = _mm512_fmadd_ps(kc, u[j], _mm512_mul_ps(dc, load(row + j * kW, m[j])));
        store(row + j * kW, s, m[j]);
        if constexpr (kSteps) store(step_row + j * kW, s, m[j]);
        o[j] = _mm512_fmadd_ps(qc, s, o[j]);
      });
    }
    float* out = a.out + (t * a.num_heads + h) * V + v0;
    unroll<NV>([&](auto j) { store(out + j * kW, o[j], m[j]); });
  }
}

// Tokens [0, n) of `rows` through every column tile of head h's state S.
template <bool kSteps>
void recurrent_tiles(const KdaRows& rows, int64_t n, const KdaArgs& a, int64_t h, int64_t t0, float* S, float* step) {
  const int64_t V = a.head_v, tile = kTileVecs * kW;
  for (int64_t v0 = 0; v0 < V; v0 += tile) {
    __mmask16 m[kTileVecs];
    for (int j = 0; j < kTileVecs; ++j) m[j] = tail_mask(std::max<int64_t>(0, V - v0 - j * kW));
    switch ((std::min<int64_t>(V - v0, tile) + kW - 1) / kW) {
      case 1: recurrent_tile<1, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 2: recurrent_tile<2, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 3: recurrent_tile<3, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 4: recurrent_tile<4, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 5: recurrent_tile<5, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 6: recurrent_tile<6, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      case 7: recurrent_tile<7, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
      default: recurrent_tile<8, kSteps>(rows, n, a, h, t0, S, step, v0, m); break;
    }
  }
}

void kda_recurrent_avx512(const KdaArgs& a) {
  const int64_t H = a.num_heads, K = a.head_k, V = a.head_v, Kp = round_up(K, kW);
  thread_pool().parallel_for(a.num_seqs * H, [&](int64_t p0, int64_t p1) {
    thread_local KdaRows rows;
    rows.reserve(kStepBlock, Kp);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = p / H, h = p % H;
      float* S = a.states[s] + h * K * V;
      const int64_t start = a.seq_start[s], L = a.seq_len[s];
      for (int64_t b0 = 0; b0 < L; b0 += kStepBlock) {
        const int64_t n = std::min(kStepBlock, L - b0);
        prefetch_tokens(a, h, start + b0 + n, start + std::min(L, b0 + n + kStepBlock));
        for (int64_t i = 0; i < n; ++i) rows.fill(a, h, start + b0 + i, i);
        if (a.step_states != nullptr)  // [L, H, K, V]: head h of token b0
          recurrent_tiles<true>(rows, n, a, h, start + b0, S, a.step_states[s] + (b0 * H + h) * K * V);
        else
          recurrent_tiles<false>(rows, n, a, h, start + b0, S, nullptr);
      }
    }
  });
}

// ---- kda_chunked ---------------------------------------------------------------------------------
// The chunked form of kda_reference.cpp (its comment derives it). Per chunk of n <= kC tokens
// from state S0, in two parts:
//  1. Shared by every column: exp(G_i) q_i and exp(G_i) k_i (G the in-chunk cumulative log decay),
//     A (strictly lower) and B (lower) with E_ij = exp(G_i - G_j) formed as the running product
//     exp(g_i) ... exp(g_{j+1}) of per-token decays (never above 1: underflows to 0 however strong
//     the decay, never overflows; one multiply per entry instead of an exp), and the last row
//     E_{n-1,j} k_j for the state update. The three [n, K] operands of part 2 are stored
//     transposed, [K, kC], so a state row meets its kC coefficients at one address.
//  2. Per column tile of 16: w_i = S0^T (exp(G_i) k_i) and z_i = S0^T (exp(G_i) q_i) (8 tokens at
//     a time against each state row), u_i = beta_i (v_i - w_i - sum_{m<i} A_im u_m), o_i = z_i +
//     sum_{j<=i} B_ij u_j, S = exp(G_{n-1}) S0 + sum_j (E_{n-1,j} k_j) u_j^T.
// The state is read and written once per chunk. Work per token: 3 K V multiply-adds for the state
// products (vs 4 K V step by step, whose passes load and store the state per token) plus ~kC K
// for A and B and kC V for the triangular parts, so the chunk stays short. Rows past n are zero,
// so the fixed-size loops run whole chunks.
// Tokens per chunk, measured (kernel_bench --kda-only, 1024 tokens, 12 heads x 128, 1 thread, a
// busy Zen 5): 8: 17-18 us per token, 16: 18-20, 32: 24-30, 64: 33-39; step by step 23-24.
constexpr int64_t kChunk = 8;
constexpr int64_t kGroup = 8;   // tokens per pass over a state tile: 16 accumulators

template <int64_t kC>
struct ChunkScratch {
  KdaRows rows;                    // [kC, Kp]
  std::vector<float> qgT, kgT;     // [Kp, kC]: exp(G_i) q_i, exp(G_i) k_i, transposed
  std::vector<float> kdT;          // [Kp, kC]: E_{n-1,j} k_j, transposed
  std::vector<float> gamma, run;   // [Kp]: exp(G_i) as i advances; the running product E_ij
  std::vector<float> A, B;         // [kC, kC]
  std::vector<float> w, z, u;      // [kC, 16]: one column tile
  void reserve(int64_t Kp) {
    rows.reserve(kC, Kp);
    for (auto* v : {&qgT, &kgT, &kdT})
      if (v->size() < static_cast<size_t>(kC * Kp)) v->resize(static_cast<size_t>(kC * Kp));
    for (auto* v : {&gamma, &run})
      if (v->size() < static_cast<size_t>(Kp)) v->resize(static_cast<size_t>(Kp));
    A.resize(kC * kC);
    B.resize(kC * kC);
    for (auto* v : {&w, &z, &u}) v->resize(kC * kW);
  }
};

// Part 1 for the n tokens already in cs.rows.
template <int64_t kC>
void chunk_prepare(ChunkScratch<kC>& cs, int64_t n) {
  const int64_t Kp = cs.rows.Kp;
  const float* q = cs.rows.q.data();
  const float* k = cs.rows.k.data();
  const float* d = cs.rows.decay.data();
  float* gamma = cs.gamma.data();
  float* run = cs.run.data();
  if (n < kC)  // a short last chunk: columns past n are zero (columns below n are all written)
    for (int64_t c = 0; c < Kp; ++c)
      for (int64_t i = n; i < kC; ++i) cs.qgT[c * kC + i] = cs.kgT[c * kC + i] = cs.kdT[c * kC + i] = 0.0f;
  std::fill(cs.A.begin(), cs.A.end(), 0.0f);
  std::fill(cs.B.begin(), cs.B.end(), 0.0f);
  std::fill(gamma, gamma + Kp, 1.0f);
  alignas(64) float qg[kW], kg[kW];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < Kp; c += kW) {
      const __m512 G = _mm512_mul_ps(load(gamma + c), load(d + i * Kp + c));
      store(gamma + c, G);
      store(qg, _mm512_mul_ps(G, load(q + i * Kp + c)));
      store(kg, _mm512_mul_ps(G, load(k + i * Kp + c)));
      for (int64_t l = 0; l < kW; ++l) {
        cs.qgT[(c + l) * kC + i] = qg[l];
        cs.kgT[(c + l) * kC + i] = kg[l];
      }
    }
  for (int64_t i = 0; i < n; ++i) {
    std::fill(run, run + Kp, 1.0f);  // E_ii = 1
    const bool last = i == n - 1;
    for (int64_t j = i; j >= 0; --j) {
      __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
      for (int64_t c = 0; c < Kp; c += kW) {
        __m512 e = load(run + c);
        if (j < i) {
          e = _mm512_mul_ps(e, load(d + (j + 1) * Kp + c));  // E_ij = E_i,j+1 exp(g_{j+1})
          store(run + c, e);
        }
        const __m512 ke = _mm512_mul_ps(load(k + j * Kp + c), e);
        acc_a = _mm512_fmadd_ps(load(k + i * Kp + c), ke, acc_a);
        acc_b = _mm512_fmadd_ps(load(q + i * Kp + c), ke, acc_b);
        if (last) {
          store(kg, ke);
          for (int64_t l = 0; l < kW; ++l) cs.kdT[(c + l) * kC + j] = kg[l];
        }
      }
      if (j < i) cs.A[i * kC + j] = hsum(acc_a);
      cs.B[i * kC + j] = hsum(acc_b);
    }
  }
}

// Part 2 for state columns [v0, v0 + 16) (mask m) of head h, tokens t0 .. t0 + n - 1. The next
// tile's state rows are prefetched during the first pass over this one's.
template <int64_t kC>
void chunk_tile(ChunkScratch<kC>& cs, int64_t n, const KdaArgs& a, int64_t h, int64_t t0, float* S, int64_t v0,
                __mmask16 m) {
  const int64_t K = a.head_k, V = a.head_v;
  const bool prefetch_next = v0 + kW < V;
  for (int64_t i = 0; i < n; ++i)  // into L1 for the substitution below, while the first pass runs
    _mm_prefetch(reinterpret_cast<const char*>(a.v + (t0 + i) * a.v_stride + h * V + v0), _MM_HINT_T0);
  // w = S0^T kg, z = S0^T qg, kGroup tokens per pass over the tile
  for (int64_t i0 = 0; i0 < n; i0 += kGroup) {
    __m512 w[kGroup], z[kGroup];
    unroll<kGroup>([&](auto r) { w[r] = z[r] = _mm512_setzero_ps(); });
    const float* kg = &cs.kgT[i0];
    const float* qg = &cs.qgT[i0];
    for (int64_t c = 0; c < K; ++c) {
      const __m512 s = load(S + c * V + v0, m);
      if (i0 == 0 && prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(S + c * V + v0 + kW), _MM_HINT_T0);
      unroll<kGroup>([&](auto r) {
        w[r] = _mm512_fmadd_ps(splat(kg[c * kC + r]), s, w[r]);
        z[r] = _mm512_fmadd_ps(splat(qg[c * kC + r]), s, z[r]);
      });
    }
    unroll<kGroup>([&](auto r) {
      store(&cs.w[(i0 + r) * kW], w[r]);
      store(&cs.z[(i0 + r) * kW], z[r]);
    });
  }
  // u by forward substitution, then o
  const float* beta = cs.rows.beta.data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    __m512 r = _mm512_sub_ps(load(a.v + t * a.v_stride + h * V + v0, m), load(&cs.w[i * kW]));
    for (int64_t j = 0; j < i; ++j) r = _mm512_fnmadd_ps(splat(cs.A[i * kC + j]), load(&cs.u[j * kW]), r);
    const __m512 u = _mm512_mul_ps(splat(beta[i]), r);
    store(&cs.u[i * kW], u);
    __m512 o = _mm512_fmadd_ps(splat(cs.B[i * kC + i]), u, load(&cs.z[i * kW]));
    for (int64_t j = 0; j < i; ++j) o = _mm512_fmadd_ps(splat(cs.B[i * kC + j]), load(&cs.u[j * kW]), o);
    store(a.out + (t * a.num_heads + h) * V + v0, o, m);
  }
  for (int64_t i = n; i < kC; ++i) store(&cs.u[i * kW], _mm512_setzero_ps());
  // S = exp(G_{n-1}) S0 + sum_j kd_j u_j^T (kd columns past n are zero)
  __m512 u[kC];
  unroll<kC>([&](auto j) { u[j] = load(&cs.u[j * kW]); });
  const float* kd = cs.kdT.data();
  for (int64_t c = 0; c < K; ++c) {
    float* row = S + c * V + v0;
    __m512 s = _mm512_mul_ps(splat(cs.gamma[c]), load(row, m));
    unroll<kC>([&](auto j) { s = _mm512_fmadd_ps(splat(kd[c * kC + j]), u[j], s); });
    store(row, s, m);
  }
}

// Chunk index outer, (sequence, head) pairs split over the pool inside: a step's token rows
// (q, k, v, g: [T, H * K] each) are read by every head's task while they sit in cache, instead of
// each task striding through all of a long sequence's rows alone.
template <int64_t kC>
void kda_chunked_avx512(const KdaArgs& a) {
  static_assert(kC % kGroup == 0);
  MOAT_CHECK(a.step_states == nullptr, "kda_chunked: step_states is for kda_recurrent only");
  const int64_t H = a.num_heads, K = a.head_k, V = a.head_v, Kp = round_up(K, kW);
  int64_t steps = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) steps = std::max<int64_t>(steps, (a.seq_len[s] + kC - 1) / kC);
  thread_local std::vector<int64_t> active_storage;
  std::vector<int64_t>& active = active_storage;  // the caller's: workers reach it through this reference
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t c0 = step * kC;
    active.clear();
    for (int64_t s = 0; s < a.num_seqs; ++s)
      if (a.seq_len[s] > c0) active.push_back(s);
    thread_pool().parallel_for(static_cast<int64_t>(active.size()) * H, [&](int64_t p0, int64_t p1) {
      thread_local ChunkScratch<kC> cs;
      cs.reserve(Kp);
      auto tokens_of = [&](int64_t p, int64_t& s, int64_t& h, int64_t& t0, int64_t& n) {
        s = active[p / H], h = p % H;
        t0 = a.seq_start[s] + c0, n = std::min(kC, a.seq_len[s] - c0);
      };
      for (int64_t p = p0; p < p1; ++p) {
        int64_t s, h, t0, n;
        if (p + 1 < p1) {  // the next task's rows arrive while this one runs
          tokens_of(p + 1, s, h, t0, n);
          prefetch_tokens(a, h, t0, t0 + n);
        }
        tokens_of(p, s, h, t0, n);
        if (p == p0) prefetch_tokens(a, h, t0, t0 + n);
        float* S = a.states[s] + h * K * V;
        for (int64_t i = 0; i < n; ++i) cs.rows.fill(a, h, t0 + i, i);
        chunk_prepare(cs, n);
        for (int64_t v0 = 0; v0 < V; v0 += kW) chunk_tile(cs, n, a, h, t0, S, v0, tail_mask(V - v0));
      }
    });
  }
}

}  // namespace
}  // namespace moat::ops

#pragma GCC pop_options

namespace moat::ops {

// Called by register_cpu_kernels (cpu_kernels.cpp). Priority 20, as the other avx512 kernels.
void register_cpu_kda_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn) {
    r.add(KernelEntry{op, Backend::cpu, name, fn, Constraints{.cpu_isa = "avx512"}, 20, {}});
  };
  add(OpId::short_conv, "cpu.short_conv_avx512", reinterpret_cast<void*>(&short_conv_avx512));
  add(OpId::kda_gate, "cpu.kda_gate_avx512", reinterpret_cast<void*>(&kda_gate_avx512));
  add(OpId::kda_recurrent, "cpu.kda_recurrent_avx512", reinterpret_cast<void*>(&kda_recurrent_avx512));
  add(OpId::kda_chunked, "cpu.kda_chunked_avx512", reinterpret_cast<void*>(&kda_chunked_avx512<kChunk>));
  add(OpId::gated_rms_norm, "cpu.gated_rms_norm_avx512", reinterpret_cast<void*>(&gated_rms_norm_avx512));
}

}  // namespace moat::ops
