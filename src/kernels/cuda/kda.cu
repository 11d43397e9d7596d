// CUDA kernels of the Kimi Delta Attention ops (kernel_types.h), the semantics of
// src/kernels/reference/kda_reference.cpp. Every pointer is a device pointer, the arrays of
// per-sequence state pointers (states and step_states of ShortConvArgs and KdaArgs) included: a
// device array of device pointers. Launched on the default stream (cuda_backend.h).
// Straightforward kernels, written for correctness and a clear layout rather than peak speed:
//   short_conv      one thread per (channel, sequence, block of 64 tokens), then one per (channel,
//                   sequence) shifting the state (a second launch: the first reads the old state).
//                   Step states (ShortConvArgs::step_states): one thread per (channel,
//                   sequence, token) between the two, launched only when asked for.
//   kda_gate        one thread per element.
//   gated_rms_norm  one warp per (token, head).
//   kda_recurrent   one block of 256 threads per (sequence, head, 32 state columns): lane = column,
//                   the 8 warps split the K rows, the state tile lives in registers for the whole
//                   call; each token is 4 block barriers (two reductions over the rows). Step
//                   states (KdaArgs::step_states) are stored from the registers after each token.
//   kda_chunked     the same layout and register-resident state, 16 tokens per chunk: the chunk's
//                   A and B (kda_reference.cpp's chunked form) warp by warp, S0^T (exp(G) k) and
//                   S0^T (exp(G) q) as partial sums over each warp's rows, the triangular solve
//                   and the outputs by warp 0, the state update by every thread for its rows:
//                   ~10 barriers per chunk instead of 4 per token. Each column block recomputes
//                   A and B (V / 32 times the minimum); no tensor cores yet.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.cuh"
#include "ops/registry.h"

namespace moat::ops::cuda {

// Rows of a KDA state a thread of the recurrent and chunked kernels holds, 8 warps per block:
// K <= 8 * 32.
constexpr int64_t kMaxKdaHeadDim = 256;

namespace {


constexpr int kThreads = 256;
constexpr int kRowWarps = kThreads / 32;  // warps splitting the state rows
constexpr int kConvTokens = 64;           // tokens per short_conv thread
constexpr int kChunkTokens = 16;          // kda_chunked's chunk

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- short_conv --------------------------------------------------------------------------------
__global__ void short_conv_kernel(ShortConvArgs a) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t s = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.z) * kConvTokens;
  const int64_t L = a.seq_len[s], C = a.channels, W = a.width;
  if (c >= C || i0 >= L) return;
  const int64_t start = a.seq_start[s];
  const float* state = a.states[s];
  const int64_t i1 = i0 + kConvTokens < L ? i0 + kConvTokens : L;
  for (int64_t i = i0; i < i1; ++i) {
    float acc = 0.0f;
    for (int64_t j = 0; j < W; ++j) {
      const int64_t p = i - (W - 1) + j;
      const float in = p >= 0 ? a.x[(start + p) * a.x_stride + c] : state[(W - 1 + p) * C + c];
      acc += a.weight[c * W + j] * in;
    }
    a.y[(start + i) * a.y_stride + c] = acc * sigmoidf(acc);
  }
}

// Step states, when asked for: thread (channel, sequence, tokens i = blockIdx.z + k gridDim.z)
// writes the state after token i, inputs i + 1 - (W-1) .. i, into step_states[s] [L, W-1, C].
// Launched between the two above, while the state still holds the inputs before the call.
__global__ void short_conv_steps_kernel(ShortConvArgs a) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t s = blockIdx.y, L = a.seq_len[s], C = a.channels, W = a.width;
  if (c >= C) return;
  const int64_t start = a.seq_start[s];
  const float* state = a.states[s];
  for (int64_t i = blockIdx.z; i < L; i += gridDim.z) {
    float* step = a.step_states[s] + i * (W - 1) * C;
    for (int64_t r = 0; r < W - 1; ++r) {
      const int64_t p = i + 1 - (W - 1) + r;
      step[r * C + c] = p >= 0 ? a.x[(start + p) * a.x_stride + c] : state[(W - 1 + p) * C + c];
    }
  }
}

// The last W-1 inputs into the state, in place: row r takes input L - (W-1) + r, from x or from
// state row r + L, which this thread has not overwritten yet (rows in increasing order).
__global__ void short_conv_state_kernel(ShortConvArgs a) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t s = blockIdx.y, L = a.seq_len[s], C = a.channels, W = a.width;
  if (c >= C || L == 0) return;
  const int64_t start = a.seq_start[s];
  float* state = a.states[s];
  for (int64_t r = 0; r < W - 1; ++r) {
    const int64_t p = L - (W - 1) + r;
    state[r * C + c] = p >= 0 ? a.x[(start + p) * a.x_stride + c] : state[(W - 1 + p) * C + c];
  }
}

// ---- kda_gate, gated_rms_norm ------------------------------------------------------------------
__global__ void kda_gate_kernel(KdaGateArgs a) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t K = a.head_dim, H = a.num_heads;
  if (i >= a.num_tokens * H * K) return;
  const int64_t hk = i % (H * K), h = hk / K;
  const float A = expf(a.a_log[h]);
  const float x = a.raw[i] + a.dt_bias[hk];
  if (a.lower_bound < 0.0f) {
    a.g[i] = a.lower_bound * sigmoidf(A * x);
  } else {
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    a.g[i] = -A * sp;
  }
}

__global__ void gated_rms_norm_kernel(GatedRmsNormArgs a) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= a.num_tokens * a.num_heads) return;
  const int64_t D = a.head_dim;
  const float* x = a.x + row * D;
  const float* gate = a.gate + row * D;
  float* y = a.y + row * D;
  float ss = 0.0f;
  for (int64_t d = lane; d < D; d += 32) ss += x[d] * x[d];
  const float inv = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(D) + a.eps);
  for (int64_t d = lane; d < D; d += 32) y[d] = x[d] * inv * a.weight[d] * sigmoidf(gate[d]);
}

// ---- kda_recurrent -------------------------------------------------------------------------------
// Block (sequence, head) = blockIdx.x, columns [32 blockIdx.y, +32). Thread: column = lane, rows
// c = warp + 8 m (m < kPer) of the state tile in st[m]. kSteps: step_states is set, and the tile
// is stored there after each token; a separate instantiation, as a runtime test cost the ordinary
// kernel registers (ptxas at kPer = 32: 110 -> 128 and a spill).
template <int kPer, bool kSteps>
__global__ void __launch_bounds__(kThreads) kda_recurrent_kernel(KdaArgs a) {
  __shared__ float sq[kMaxKdaHeadDim], sk[kMaxKdaHeadDim], sd[kMaxKdaHeadDim];
  __shared__ float red_kv[kRowWarps][32], red_o[kRowWarps][32], red_norm[kRowWarps][2];
  const int64_t H = a.num_heads, K = a.head_k, V = a.head_v;
  const int64_t s = blockIdx.x / H, h = blockIdx.x % H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t col = blockIdx.y * 32 + lane;
  const bool has_col = col < V;
  float* S = a.states[s] + h * K * V;
  // step_states[s] [L, H, K, V] at head h of token 0, H K V floats from one token to the next
  [[maybe_unused]] float* step = kSteps ? a.step_states[s] + h * K * V : nullptr;
  float st[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int64_t c = warp + kRowWarps * m;
    st[m] = c < K && has_col ? S[c * V + col] : 0.0f;
  }
  const int64_t start = a.seq_start[s], end = start + a.seq_len[s];
  const float q_scale = 1.0f / sqrtf(static_cast<float>(K));
  for (int64_t t = start; t < end; ++t) {
    __syncthreads();  // the previous token is done with the shared arrays
    float pq = 0.0f, pk = 0.0f;
    for (int64_t c = threadIdx.x; c < K; c += kThreads) {
      const float qv = a.q[t * a.qk_stride + h * K + c], kv = a.k[t * a.qk_stride + h * K + c];
      sq[c] = qv;
      sk[c] = kv;
      sd[c] = expf(a.g[(t * H + h) * K + c]);
      pq += qv * qv;
      pk += kv * kv;
    }
    pq = warp_sum(pq);
    pk = warp_sum(pk);
    if (lane == 0) red_norm[warp][0] = pq, red_norm[warp][1] = pk;
    __syncthreads();
    float qq = 0.0f, kk = 0.0f;
    for (int w = 0; w < kRowWarps; ++w) qq += red_norm[w][0], kk += red_norm[w][1];
    const float inv_q = q_scale / sqrtf(qq + 1e-6f), inv_k = 1.0f / sqrtf(kk + 1e-6f);
    // kv = S^T (k exp(g)) over this thread's rows, then over the warps
    float part = 0.0f;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int64_t c = warp + kRowWarps * m;
      if (c < K) part += sk[c] * sd[c] * st[m];
    }
    red_kv[warp][lane] = part;
    __syncthreads();
    float kv = 0.0f;
    for (int w = 0; w < kRowWarps; ++w) kv += red_kv[w][lane];
    const float beta = sigmoidf(a.beta[t * H + h]);
    const float u = has_col ? beta * (a.v[t * a.v_stride + h * V + col] - kv * inv_k) : 0.0f;
    // S <- exp(g) S + k u^T, o = S^T q
    float po = 0.0f;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int64_t c = warp + kRowWarps * m;
      if (c < K) {
        st[m] = sd[c] * st[m] + sk[c] * inv_k * u;
        po += sq[c] * st[m];
      }
    }
    red_o[warp][lane] = po;
    if constexpr (kSteps) {
      float* dst = step + (t - start) * H * K * V;
#pragma unroll
      for (int m = 0; m < kPer; ++m) {
        const int64_t c = warp + kRowWarps * m;
        if (c < K && has_col) dst[c * V + col] = st[m];
      }
    }
    __syncthreads();
    if (warp == 0 && has_col) {
      float o = 0.0f;
      for (int w = 0; w < kRowWarps; ++w) o += red_o[w][lane];
      a.out[(t * H + h) * V + col] = o * inv_q;
    }
  }
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int64_t c = warp + kRowWarps * m;
    if (c < K && has_col) S[c * V + col] = st[m];
  }
}

// ---- kda_chunked ---------------------------------------------------------------------------------
// Shared memory of one block (floats).
__host__ __device__ inline int64_t chunked_smem_floats(int64_t K) {
  const int64_t C = kChunkTokens;
  return 4 * C * K            // q, k (normalized, then times exp(G_i)), exp(g), E_{n-1,j} k_j
         + kRowWarps * C * 32  // partial sums over each warp's rows
         + 2 * C * C           // A, B
         + C * 32              // w, then u, per column
         + K + 3 * C;          // exp(G_{n-1}); beta; inverse norms of q and k
}

template <int kPer>
__global__ void __launch_bounds__(kThreads) kda_chunked_kernel(KdaArgs a) {
  constexpr int C = kChunkTokens;
  extern __shared__ float smem[];
  const int64_t H = a.num_heads, K = a.head_k, V = a.head_v;
  float* sq = smem;                  // [C, K]
  float* sk = sq + C * K;            // [C, K]
  float* sd = sk + C * K;            // [C, K] exp(g)
  float* skd = sd + C * K;           // [C, K] E_{n-1,j} k_j
  float* red = skd + C * K;          // [8, C, 32]
  float* sA = red + kRowWarps * C * 32;  // [C, C]
  float* sB = sA + C * C;            // [C, C]
  float* su = sB + C * C;            // [C, 32]
  float* sgam = su + C * 32;         // [K]
  float* sbeta = sgam + K;           // [C]
  float* snorm = sbeta + C;          // [C, 2]
  const int64_t s = blockIdx.x / H, h = blockIdx.x % H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t col = blockIdx.y * 32 + lane;
  const bool has_col = col < V;
  float* S = a.states[s] + h * K * V;
  float st[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int64_t c = warp + kRowWarps * m;
    st[m] = c < K && has_col ? S[c * V + col] : 0.0f;
  }
  const int64_t start = a.seq_start[s], L = a.seq_len[s];
  const float q_scale = 1.0f / sqrtf(static_cast<float>(K));
  for (int64_t c0 = 0; c0 < L; c0 += C) {
    const int n = static_cast<int>(L - c0 < C ? L - c0 : C);
    const int64_t t0 = start + c0;
    __syncthreads();  // the previous chunk is done with shared memory
    // 1. the chunk's q, k, exp(g); inverse norms and beta
    for (int64_t idx = threadIdx.x; idx < n * K; idx += kThreads) {
      const int64_t i = idx / K, c = idx % K, t = t0 + i;
      sq[idx] = a.q[t * a.qk_stride + h * K + c];
      sk[idx] = a.k[t * a.qk_stride + h * K + c];
      sd[idx] = expf(a.g[(t * H + h) * K + c]);
    }
    __syncthreads();
    for (int i = warp; i < n; i += kRowWarps) {
      float pq = 0.0f, pk = 0.0f;
      for (int64_t c = lane; c < K; c += 32) pq += sq[i * K + c] * sq[i * K + c], pk += sk[i * K + c] * sk[i * K + c];
      pq = warp_sum(pq);
      pk = warp_sum(pk);
      if (lane == 0) {
        snorm[2 * i] = q_scale / sqrtf(pq + 1e-6f);
        snorm[2 * i + 1] = 1.0f / sqrtf(pk + 1e-6f);
        sbeta[i] = sigmoidf(a.beta[(t0 + i) * H + h]);
      }
    }
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < n * K; idx += kThreads) {
      const int64_t i = idx / K;
      sq[idx] *= snorm[2 * i];
      sk[idx] *= snorm[2 * i + 1];
    }
    __syncthreads();
    // 2. A (strictly lower), B (lower) and E_{n-1,j} k_j, one warp per (i, j); E_ij as the product
    //    exp(g_{j+1}) ... exp(g_i), never above 1
    for (int p = warp; p < n * n; p += kRowWarps) {
      const int i = p / n, j = p % n;
      if (j > i) continue;
      float pa = 0.0f, pb = 0.0f;
      for (int64_t c = lane; c < K; c += 32) {
        float e = 1.0f;
        for (int m = j + 1; m <= i; ++m) e *= sd[m * K + c];
        const float ke = sk[j * K + c] * e;
        pa += sk[i * K + c] * ke;
        pb += sq[i * K + c] * ke;
        if (i == n - 1) skd[j * K + c] = ke;
      }
      pa = warp_sum(pa);
      pb = warp_sum(pb);
      if (lane == 0) {
        sA[i * C + j] = j < i ? pa : 0.0f;
        sB[i * C + j] = pb;
      }
    }
    __syncthreads();
    // 3. q and k times exp(G_i) in place; exp(G_{n-1})
    for (int64_t c = threadIdx.x; c < K; c += kThreads) {
      float G = 1.0f;
      for (int i = 0; i < n; ++i) {
        G *= sd[i * K + c];
        sq[i * K + c] *= G;
        sk[i * K + c] *= G;
      }
      sgam[c] = G;
    }
    __syncthreads();
    // 4. w_i = S0^T (exp(G_i) k_i), summed over the warps into su
    for (int i = 0; i < n; ++i) {
      float part = 0.0f;
#pragma unroll
      for (int m = 0; m < kPer; ++m) {
        const int64_t c = warp + kRowWarps * m;
        if (c < K) part += sk[i * K + c] * st[m];
      }
      red[(warp * C + i) * 32 + lane] = part;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n * 32; idx += kThreads) {
      float w = 0.0f;
      for (int r = 0; r < kRowWarps; ++r) w += red[r * C * 32 + idx];
      su[idx] = w;
    }
    __syncthreads();
    //    z_i = S0^T (exp(G_i) q_i), left as partial sums
    for (int i = 0; i < n; ++i) {
      float part = 0.0f;
#pragma unroll
      for (int m = 0; m < kPer; ++m) {
        const int64_t c = warp + kRowWarps * m;
        if (c < K) part += sq[i * K + c] * st[m];
      }
      red[(warp * C + i) * 32 + lane] = part;
    }
    __syncthreads();
    // 5. warp 0, one column per lane: u_i = beta_i (v_i - w_i - sum_{j<i} A_ij u_j) over su in
    //    place, o_i = z_i + sum_{j<=i} B_ij u_j
    if (warp == 0) {
      for (int i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        float r = (has_col ? a.v[t * a.v_stride + h * V + col] : 0.0f) - su[i * 32 + lane];
        for (int j = 0; j < i; ++j) r -= sA[i * C + j] * su[j * 32 + lane];
        const float u = has_col ? sbeta[i] * r : 0.0f;
        su[i * 32 + lane] = u;
        float o = 0.0f;
        for (int w = 0; w < kRowWarps; ++w) o += red[(w * C + i) * 32 + lane];
        for (int j = 0; j <= i; ++j) o += sB[i * C + j] * su[j * 32 + lane];
        if (has_col) a.out[(t * H + h) * V + col] = o;
      }
    }
    __syncthreads();
    // 6. S = exp(G_{n-1}) S0 + sum_j (E_{n-1,j} k_j) u_j^T, each thread its rows
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int64_t c = warp + kRowWarps * m;
      if (c < K) {
        float acc = sgam[c] * st[m];
        for (int j = 0; j < n; ++j) acc += skd[j * K + c] * su[j * 32 + lane];
        st[m] = acc;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int64_t c = warp + kRowWarps * m;
    if (c < K && has_col) S[c * V + col] = st[m];
  }
}

// Rows per thread for head dim K: 8 warps * kPer >= K.
int rows_per_thread(int64_t K) {
  if (K > kMaxKdaHeadDim) {
    std::fprintf(stderr, "cuda kda: head dim %lld > %lld (the registered constraint)\n", static_cast<long long>(K),
                 static_cast<long long>(kMaxKdaHeadDim));
    std::abort();
  }
  int per = 1;
  while (kRowWarps * per < K) per *= 2;
  return per;
}

template <int kPer>
void launch_chunked(const KdaArgs& a, dim3 grid) {
  const size_t bytes = sizeof(float) * chunked_smem_floats(a.head_k);
  static size_t opted_in = 48 << 10;  // past the default 48 KiB, once per instantiation
  if (bytes > opted_in) {
    MOAT_CUDA_OK(cudaFuncSetAttribute(kda_chunked_kernel<kPer>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
    opted_in = bytes;
  }
  kda_chunked_kernel<kPer><<<grid, kThreads, bytes>>>(a);
}

template <bool kSteps>
void launch_recurrent(const KdaArgs& a, dim3 grid) {
  switch (rows_per_thread(a.head_k)) {
    case 1: kda_recurrent_kernel<1, kSteps><<<grid, kThreads>>>(a); break;
    case 2: kda_recurrent_kernel<2, kSteps><<<grid, kThreads>>>(a); break;
    case 4: kda_recurrent_kernel<4, kSteps><<<grid, kThreads>>>(a); break;
    case 8: kda_recurrent_kernel<8, kSteps><<<grid, kThreads>>>(a); break;
    case 16: kda_recurrent_kernel<16, kSteps><<<grid, kThreads>>>(a); break;
    default: kda_recurrent_kernel<32, kSteps><<<grid, kThreads>>>(a); break;
  }
}

}  // namespace

void short_conv(const ShortConvArgs& a) {
  if (a.num_seqs == 0 || a.channels == 0 || a.num_tokens == 0) return;
  const dim3 grid(static_cast<unsigned>((a.channels + 127) / 128), static_cast<unsigned>(a.num_seqs),
                  static_cast<unsigned>((a.num_tokens + kConvTokens - 1) / kConvTokens));
  short_conv_kernel<<<grid, 128>>>(a);
  MOAT_CUDA_OK(cudaGetLastError());
  if (a.step_states != nullptr) {  // up to one block row per token of the call
    const int64_t rows = a.num_tokens < 65535 ? a.num_tokens : 65535;  // gridDim.z's limit
    short_conv_steps_kernel<<<dim3(static_cast<unsigned>((a.channels + 127) / 128), static_cast<unsigned>(a.num_seqs),
                                   static_cast<unsigned>(rows)),
                              128>>>(a);
    MOAT_CUDA_OK(cudaGetLastError());
  }
  short_conv_state_kernel<<<dim3(static_cast<unsigned>((a.channels + 127) / 128), static_cast<unsigned>(a.num_seqs)),
                            128>>>(a);
  MOAT_CUDA_OK(cudaGetLastError());
}

void kda_gate(const KdaGateArgs& a) {
  const int64_t n = a.num_tokens * a.num_heads * a.head_dim;
  if (n == 0) return;
  kda_gate_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads>>>(a);
  MOAT_CUDA_OK(cudaGetLastError());
}

void gated_rms_norm(const GatedRmsNormArgs& a) {
  const int64_t rows = a.num_tokens * a.num_heads;
  if (rows == 0) return;
  gated_rms_norm_kernel<<<static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps), kThreads>>>(a);
  MOAT_CUDA_OK(cudaGetLastError());
}

void kda_recurrent(const KdaArgs& a) {
  if (a.num_seqs == 0 || a.num_heads == 0) return;
  const dim3 grid(static_cast<unsigned>(a.num_seqs * a.num_heads), static_cast<unsigned>((a.head_v + 31) / 32));
  if (a.step_states != nullptr)
    launch_recurrent<true>(a, grid);
  else
    launch_recurrent<false>(a, grid);
  MOAT_CUDA_OK(cudaGetLastError());
}

void kda_chunked(const KdaArgs& a) {
  if (a.step_states != nullptr) {
    std::fprintf(stderr, "cuda kda_chunked: step_states is for kda_recurrent only\n");
    std::abort();
  }
  if (a.num_seqs == 0 || a.num_heads == 0) return;
  const dim3 grid(static_cast<unsigned>(a.num_seqs * a.num_heads), static_cast<unsigned>((a.head_v + 31) / 32));
  switch (rows_per_thread(a.head_k)) {
    case 1: launch_chunked<1>(a, grid); break;
    case 2: launch_chunked<2>(a, grid); break;
    case 4: launch_chunked<4>(a, grid); break;
    case 8: launch_chunked<8>(a, grid); break;
    case 16: launch_chunked<16>(a, grid); break;
    default: launch_chunked<32>(a, grid); break;
  }
  MOAT_CUDA_OK(cudaGetLastError());
}

}  // namespace moat::ops::cuda

namespace moat::ops {

// Called by register_cuda_kernels (cuda_registry.cpp). The two KDA kernels keep a thread's rows
// of the state in registers: head dims up to kMaxKdaHeadDim.
void register_cuda_kda_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn, Constraints c) {
    r.add(KernelEntry{op, Backend::cuda, name, fn, std::move(c), 10, {}});
  };
  Constraints kda;
  kda.max_head_dim = cuda::kMaxKdaHeadDim;
  add(OpId::short_conv, "cuda.short_conv", reinterpret_cast<void*>(&cuda::short_conv), {});
  add(OpId::kda_gate, "cuda.kda_gate", reinterpret_cast<void*>(&cuda::kda_gate), {});
  add(OpId::kda_recurrent, "cuda.kda_recurrent", reinterpret_cast<void*>(&cuda::kda_recurrent), kda);
  add(OpId::kda_chunked, "cuda.kda_chunked", reinterpret_cast<void*>(&cuda::kda_chunked), kda);
  add(OpId::gated_rms_norm, "cuda.gated_rms_norm", reinterpret_cast<void*>(&cuda::gated_rms_norm), {});
}

}  // namespace moat::ops
