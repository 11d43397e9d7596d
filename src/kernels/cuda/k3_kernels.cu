// CUDA kernels of Kimi K3's ops (cuda_backend.h for pointer and stream rules; the semantics are
// kernel_types.h's and src/kernels/reference/k3_reference_kernels.cpp's):
//   situ_mul, sigmoid_mul  one thread per element (tanhf / expf: full-precision libdevice, ~2 ulp).
//   attn_res_mix           one block per token: a block reduction per row for its sum of squares
//                          and its dot with the weight (in double), the row softmax on one thread
//                          (double), then every thread writes its share of the weighted sum. The
//                          row pointers travel in the kernel's parameters (up to kInlineRows;
//                          beyond, a device copy of the pointer array).
// moe_experts (kernels.cu) runs situ_mul through its InnerOps when the activation is SiTU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.cuh"

namespace moat::ops::cuda {
namespace {


constexpr int kThreads = 256;
constexpr int kInlineRows = 32;

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__device__ float sigmoid_dev(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void situ_mul_kernel(const float* g, const float* u, int64_t n, float beta, float linear_beta, float* y) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i], ui = u[i];  // y may alias g
  y[i] = beta * tanhf(gi / beta) * sigmoid_dev(gi) * (linear_beta * tanhf(ui / linear_beta));
}

__global__ void sigmoid_mul_kernel(const float* x, const float* gate, int64_t n, float* y) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = x[i] * sigmoid_dev(gate[i]);
}

struct AttnResParams {
  const float* inline_rows[kInlineRows];  // num_rows <= kInlineRows
  const float* const* dev_rows;           // else: [num_rows] in device memory
  int64_t num_rows, dim;
  const float* weight;  // [dim]
  float eps;
  float* out;           // [T, dim]
};

__device__ const float* row_ptr(const AttnResParams& a, int64_t r) {
  return a.dev_rows ? a.dev_rows[r] : a.inline_rows[r];
}

// (sum of x, sum of y) over the block; every thread gets the result.
__device__ double2 block_sum2(double2 v) {
  __shared__ double2 part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  __syncthreads();  // part may still be read from the previous call
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  double2 s = make_double2(0.0, 0.0);
  for (int i = 0; i < kThreads / 32; ++i) s.x += part[i].x, s.y += part[i].y;
  return s;
}

// Row sums and the softmax in double, as the cpu kernel (k3_generic.inc) has them: the softmax
// passes an absolute score error on as a relative error of p, and fp32 sums of dim ~7168 terms
// would be ~1e-4 off when scores are ~sqrt(dim). The kernel is bound by reading the rows, and an
// sm_90 part has FP64 at half the fp32 rate, so the double sums cost nothing measurable.
__global__ void attn_res_mix_kernel(AttnResParams a) {
  extern __shared__ double p[];  // [num_rows] scores, then probabilities
  const int64_t t = blockIdx.x, D = a.dim, R = a.num_rows;
  for (int64_t r = 0; r < R; ++r) {
    const float* x = row_ptr(a, r) + t * D;
    double2 acc = make_double2(0.0, 0.0);  // (sum x^2, sum x * w)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const double v = x[d];
      acc.x += v * v;
      acc.y += v * a.weight[d];
    }
    acc = block_sum2(acc);
    if (threadIdx.x == 0) p[r] = acc.y / sqrt(acc.x / static_cast<double>(D) + a.eps);
  }
  if (threadIdx.x == 0) {
    double m = -INFINITY;
    for (int64_t r = 0; r < R; ++r) m = fmax(m, p[r]);
    double sum = 0.0;
    for (int64_t r = 0; r < R; ++r) sum += (p[r] = exp(p[r] - m));
    for (int64_t r = 0; r < R; ++r) p[r] /= sum;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t r = 0; r < R; ++r) acc += static_cast<float>(p[r]) * row_ptr(a, r)[t * D + d];
    a.out[t * D + d] = acc;
  }
}

}  // namespace

void situ_mul(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta, float* y) {
  if (T * n == 0) return;
  situ_mul_kernel<<<blocks_for(T * n), kThreads>>>(gate, up, T * n, beta, linear_beta, y);
  MOAT_CUDA_OK(cudaGetLastError());
}

void sigmoid_mul(const float* x, const float* gate, int64_t n, float* y) {
  if (n == 0) return;
  sigmoid_mul_kernel<<<blocks_for(n), kThreads>>>(x, gate, n, y);
  MOAT_CUDA_OK(cudaGetLastError());
}

void attn_res_mix(const AttnResMixArgs& a) {
  if (a.num_rows < 1) {
    std::fprintf(stderr, "cuda.attn_res_mix: needs at least one row, got %lld\n", static_cast<long long>(a.num_rows));
    std::abort();
  }
  if (a.num_tokens == 0 || a.dim == 0) return;
  AttnResParams p{};
  p.num_rows = a.num_rows;
  p.dim = a.dim;
  p.weight = a.weight;
  p.eps = a.eps;
  p.out = a.out;
  if (a.num_rows <= kInlineRows) {
    for (int64_t r = 0; r < a.num_rows; ++r) p.inline_rows[r] = a.rows[r];
  } else {
    // Rare (K3 mixes at most ~9 rows): the pointer array goes to a grow-only device buffer.
    // cudaMemcpy is ordered on the default stream after any kernel still reading the old one.
    static const float** dev_rows = nullptr;
    static int64_t capacity = 0;
    if (a.num_rows > capacity) {
      if (dev_rows) MOAT_CUDA_OK(cudaFree(dev_rows));
      MOAT_CUDA_OK(cudaMalloc(&dev_rows, sizeof(const float*) * a.num_rows));
      capacity = a.num_rows;
    }
    MOAT_CUDA_OK(cudaMemcpy(dev_rows, a.rows, sizeof(const float*) * a.num_rows, cudaMemcpyHostToDevice));
    p.dev_rows = dev_rows;
  }
  // Rounded up to 4 doubles: the weighted-sum loop's remainder (after its 4-way unroll) loads
  // p[r] and p[r + 1] as one 16-byte LDS.128 before testing whether a second row is left (SASS of
  // the sm_90 build), so with an odd row count it reads 8 bytes past p. The value is unused, but
  // compute-sanitizer's memcheck flagged it on an H200 (num_rows = 1) and killed the kernel; the
  // padding is never written and never weighted.
  const size_t shared = sizeof(double) * ((a.num_rows + 3) / 4 * 4);
  attn_res_mix_kernel<<<static_cast<unsigned>(a.num_tokens), kThreads, shared>>>(p);
  MOAT_CUDA_OK(cudaGetLastError());
}

}  // namespace moat::ops::cuda
