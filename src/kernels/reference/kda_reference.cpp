// Scalar reference kernels of the Kimi Delta Attention ops (kernel_types.h: ShortConvArgs,
// KdaGateArgs, KdaArgs, GatedRmsNormArgs): the oracle the cpu and cuda kernels are tested against
// and the cpu backend's declared fallback. Clarity first, every sum in double. A sequence's state
// is read into double at the start of a call and rounded to fp32 once at its end (step states,
// when asked for, are fp32 copies of it after each token: the last one is the final state).
#include <algorithm>
#include <cmath>
#include <vector>

#include "base/check.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

namespace moat::ops {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
// torch.nn.functional.softplus with its default threshold: x itself past 20.
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

void short_conv_ref(const ShortConvArgs& a) {
  const int64_t C = a.channels, W = a.width;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t start = a.seq_start[s], L = a.seq_len[s];
    float* state = a.states[s];  // [W-1, C], oldest first
    // Input p of this call's part of the sequence (p < 0: the state's rows, p = -1 the newest).
    auto input = [&](int64_t p, int64_t c) -> double {
      return p >= 0 ? a.x[(start + p) * a.x_stride + c] : state[(W - 1 + p) * C + c];
    };
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < W; ++j) acc += a.weight[c * W + j] * input(i - (W - 1) + j, c);
        a.y[(start + i) * a.y_stride + c] = static_cast<float>(silu(acc));
      }
    // The state after token i (its last W-1 inputs, inputs i - (W-1) + 1 .. i), for each i.
    if (a.step_states != nullptr)
      for (int64_t i = 0; i < L; ++i) {
        float* step = a.step_states[s] + i * (W - 1) * C;  // [W-1, C]
        for (int64_t r = 0; r < W - 1; ++r)
          for (int64_t c = 0; c < C; ++c) step[r * C + c] = static_cast<float>(input(i + 1 - (W - 1) + r, c));
      }
    // The last W-1 inputs, gathered before the state is overwritten.
    std::vector<float> next(static_cast<size_t>((W - 1) * C));
    for (int64_t r = 0; r < W - 1; ++r)
      for (int64_t c = 0; c < C; ++c) next[r * C + c] = static_cast<float>(input(L - (W - 1) + r, c));
    std::copy(next.begin(), next.end(), state);
  }
}

void kda_gate_ref(const KdaGateArgs& a) {
  const int64_t H = a.num_heads, K = a.head_dim;
  for (int64_t t = 0; t < a.num_tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double A = std::exp(static_cast<double>(a.a_log[h]));
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = t * H * K + h * K + k;
        const double x = static_cast<double>(a.raw[i]) + a.dt_bias[h * K + k];
        const double g = a.lower_bound < 0.0f ? a.lower_bound * sigmoid(A * x) : -A * softplus(x);
        a.g[i] = static_cast<float>(g);
      }
    }
}

// One head's inputs at one token, L2-normalized as the op defines (q also scaled by K^-0.5).
struct KdaToken {
  std::vector<double> q, k, decay;  // [K] each; decay = exp(g)
  std::vector<double> v;            // [V]
  double beta = 0.0;
};

KdaToken kda_token(const KdaArgs& a, int64_t t, int64_t h) {
  const int64_t K = a.head_k, V = a.head_v;
  KdaToken tok;
  tok.q.resize(K);
  tok.k.resize(K);
  tok.decay.resize(K);
  tok.v.resize(V);
  const float* q = a.q + t * a.qk_stride + h * K;
  const float* k = a.k + t * a.qk_stride + h * K;
  double qq = 0.0, kk = 0.0;
  for (int64_t c = 0; c < K; ++c) {
    qq += static_cast<double>(q[c]) * q[c];
    kk += static_cast<double>(k[c]) * k[c];
  }
  const double q_scale = 1.0 / std::sqrt(qq + 1e-6) / std::sqrt(static_cast<double>(K));
  const double k_scale = 1.0 / std::sqrt(kk + 1e-6);
  for (int64_t c = 0; c < K; ++c) {
    tok.q[c] = q[c] * q_scale;
    tok.k[c] = k[c] * k_scale;
    tok.decay[c] = std::exp(static_cast<double>(a.g[(t * a.num_heads + h) * K + c]));
  }
  for (int64_t j = 0; j < V; ++j) tok.v[j] = a.v[t * a.v_stride + h * V + j];
  tok.beta = sigmoid(a.beta[t * a.num_heads + h]);
  return tok;
}

// The state of head h of sequence s, [K, V], in double for the duration of a call.
std::vector<double> load_state(const KdaArgs& a, int64_t s, int64_t h) {
  const int64_t KV = a.head_k * a.head_v;
  const float* src = a.states[s] + h * KV;
  return std::vector<double>(src, src + KV);
}
void store_state(const KdaArgs& a, int64_t s, int64_t h, const std::vector<double>& S) {
  float* dst = a.states[s] + h * a.head_k * a.head_v;
  for (size_t i = 0; i < S.size(); ++i) dst[i] = static_cast<float>(S[i]);
}
// Head h's state after token i of sequence s into step_states[s] [seq_len, H, K, V].
void store_step_state(const KdaArgs& a, int64_t s, int64_t i, int64_t h, const std::vector<double>& S) {
  const int64_t KV = a.head_k * a.head_v;
  float* dst = a.step_states[s] + (i * a.num_heads + h) * KV;
  for (size_t j = 0; j < S.size(); ++j) dst[j] = static_cast<float>(S[j]);
}

// The definition, step by step: S <- diag(exp g) S; S <- S + beta k (v - S^T k)^T; o = S^T q.
void kda_recurrent_ref(const KdaArgs& a) {
  const int64_t K = a.head_k, V = a.head_v;
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t h = 0; h < a.num_heads; ++h) {
      std::vector<double> S = load_state(a, s, h);
      for (int64_t t = a.seq_start[s]; t < a.seq_start[s] + a.seq_len[s]; ++t) {
        const KdaToken x = kda_token(a, t, h);
        for (int64_t c = 0; c < K; ++c)
          for (int64_t j = 0; j < V; ++j) S[c * V + j] *= x.decay[c];
        for (int64_t j = 0; j < V; ++j) {
          double kv = 0.0;  // (S^T k)[j]
          for (int64_t c = 0; c < K; ++c) kv += S[c * V + j] * x.k[c];
          const double u = x.beta * (x.v[j] - kv);
          for (int64_t c = 0; c < K; ++c) S[c * V + j] += x.k[c] * u;
        }
        float* out = a.out + (t * a.num_heads + h) * V;
        for (int64_t j = 0; j < V; ++j) {
          double o = 0.0;
          for (int64_t c = 0; c < K; ++c) o += S[c * V + j] * x.q[c];
          out[j] = static_cast<float>(o);
        }
        if (a.step_states != nullptr) store_step_state(a, s, t - a.seq_start[s], h, S);
      }
      store_state(a, s, h, S);
    }
}

// The chunked form, literally (the cpu and cuda kernels compute the same sums in other orders).
// In a chunk of n tokens from state S0, with G_i = g_0 + ... + g_i per channel and
// E_ij = exp(G_i - G_j) (i >= j: never above 1, so no overflow however strong the decay):
//   u_i = beta_i (v_i - S0^T (exp(G_i) k_i) - sum_{m<i} A_im u_m),  A_im = sum_c k_i k_m E_im
//   o_i = S0^T (exp(G_i) q_i) + sum_{j<=i} B_ij u_j,                 B_ij = sum_c q_i k_j E_ij
//   S   = diag(exp(G_{n-1})) S0 + sum_j (E_{n-1,j} k_j) u_j^T
// where S_i = diag(exp G_i) S0 + sum_{j<=i} diag(E_ij) k_j u_j^T is the state after token i (by
// induction from the step), which makes u_i = beta_i (v_i - (diag(exp g_i) S_{i-1})^T k_i) the
// step's own correction.
constexpr int64_t kRefChunk = 64;

void kda_chunked_ref(const KdaArgs& a) {
  MOAT_CHECK(a.step_states == nullptr, "kda_chunked: step_states is for kda_recurrent only");
  const int64_t K = a.head_k, V = a.head_v;
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t h = 0; h < a.num_heads; ++h) {
      std::vector<double> S0 = load_state(a, s, h);
      const int64_t end = a.seq_start[s] + a.seq_len[s];
      for (int64_t t0 = a.seq_start[s]; t0 < end; t0 += kRefChunk) {
        const int64_t n = std::min(kRefChunk, end - t0);
        std::vector<KdaToken> x;
        std::vector<std::vector<double>> G(n, std::vector<double>(K));  // [n, K] cumulative log decay
        std::vector<std::vector<double>> eG(n, std::vector<double>(K));  // exp(G)
        for (int64_t i = 0; i < n; ++i) {
          x.push_back(kda_token(a, t0 + i, h));
          for (int64_t c = 0; c < K; ++c) {
            G[i][c] = (i > 0 ? G[i - 1][c] : 0.0) + a.g[((t0 + i) * a.num_heads + h) * K + c];
            eG[i][c] = std::exp(G[i][c]);
          }
        }
        auto E = [&](int64_t i, int64_t j, int64_t c) { return std::exp(G[i][c] - G[j][c]); };
        std::vector<std::vector<double>> A(n, std::vector<double>(n)), B(n, std::vector<double>(n));
        for (int64_t i = 0; i < n; ++i)
          for (int64_t m = 0; m <= i; ++m)
            for (int64_t c = 0; c < K; ++c) {
              const double e = E(i, m, c);
              if (m < i) A[i][m] += x[i].k[c] * x[m].k[c] * e;
              B[i][m] += x[i].q[c] * x[m].k[c] * e;
            }
        std::vector<std::vector<double>> u(n, std::vector<double>(V));
        for (int64_t i = 0; i < n; ++i)  // forward substitution: u_i needs u_m, m < i
          for (int64_t j = 0; j < V; ++j) {
            double r = x[i].v[j];
            for (int64_t c = 0; c < K; ++c) r -= S0[c * V + j] * eG[i][c] * x[i].k[c];
            for (int64_t m = 0; m < i; ++m) r -= A[i][m] * u[m][j];
            u[i][j] = x[i].beta * r;
          }
        for (int64_t i = 0; i < n; ++i) {
          float* out = a.out + ((t0 + i) * a.num_heads + h) * V;
          for (int64_t j = 0; j < V; ++j) {
            double o = 0.0;
            for (int64_t c = 0; c < K; ++c) o += S0[c * V + j] * eG[i][c] * x[i].q[c];
            for (int64_t m = 0; m <= i; ++m) o += B[i][m] * u[m][j];
            out[j] = static_cast<float>(o);
          }
        }
        std::vector<double> S(K * V);
        for (int64_t c = 0; c < K; ++c)
          for (int64_t j = 0; j < V; ++j) {
            double acc = eG[n - 1][c] * S0[c * V + j];
            for (int64_t m = 0; m < n; ++m) acc += E(n - 1, m, c) * x[m].k[c] * u[m][j];
            S[c * V + j] = acc;
          }
        S0 = std::move(S);
      }
      store_state(a, s, h, S0);
    }
}

void gated_rms_norm_ref(const GatedRmsNormArgs& a) {
  const int64_t H = a.num_heads, D = a.head_dim;
  for (int64_t t = 0; t < a.num_tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (t * H + h) * D;
      double ss = 0.0;
      for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(a.x[row + d]) * a.x[row + d];
      const double inv = 1.0 / std::sqrt(ss / D + a.eps);
      for (int64_t d = 0; d < D; ++d)
        a.y[row + d] = static_cast<float>(a.x[row + d] * inv * a.weight[d] * sigmoid(a.gate[row + d]));
    }
}

}  // namespace

// Called by register_reference_kernels (reference_kernels.cpp).
void register_reference_kda_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn) {
    r.add(KernelEntry{op, Backend::reference, name, fn, {}, 0, {Backend::cpu}});
  };
  add(OpId::short_conv, "reference.short_conv", reinterpret_cast<void*>(&short_conv_ref));
  add(OpId::kda_gate, "reference.kda_gate", reinterpret_cast<void*>(&kda_gate_ref));
  add(OpId::kda_recurrent, "reference.kda_recurrent", reinterpret_cast<void*>(&kda_recurrent_ref));
  add(OpId::kda_chunked, "reference.kda_chunked", reinterpret_cast<void*>(&kda_chunked_ref));
  add(OpId::gated_rms_norm, "reference.gated_rms_norm", reinterpret_cast<void*>(&gated_rms_norm_ref));
}

}  // namespace moat::ops
