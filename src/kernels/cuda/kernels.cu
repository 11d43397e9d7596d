// CUDA kernels for every op, the same semantics as src/kernels/reference (see cuda_backend.h for
// pointer and stream rules). Measured on an H200 by bench/cuda_bench.cpp (BENCHMARKS.md):
//   matmul         decode-sized calls (T <= 8, bf16 or fp8): a GEMV that streams the weights once
//                  in fp32 arithmetic. Larger: cuBLAS GemmEx bf16 x bf16 -> fp32 (activations
//                  rounded to bf16 once per call; fp8/f16 weights dequantized to a bf16 scratch
//                  matrix first, scale folded in); f32 weights: cublasSgemm.
//   mla_attention  kv_lora 512 + rope 64 (DeepSeek-V3, Kimi): flash-decoding, one block per
//                  (token, 16 heads, split of the rows) reading each cache row once for its heads,
//                  then a merge of the splits. Other widths: one block per (token, head); warps take
//                  rows of the paged cache with an online softmax, then merge through shared memory.
//   moe_experts    rows grouped by expert on the host (ids read back); experts of 1-8 rows run
//                  grouped by row count through one GEMV launch per matrix kind, larger ones a
//                  matmul each.
//   store_latent   one block per token (fp8: a block max for the row scale).
//   sampling       one block per row; top-k/top-p thresholds by binary search on the float bits
//                  (probabilities are >= 0, so their bit patterns order like their values).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.cuh"

namespace moat::ops::cuda {
namespace {

#define MOAT_CUBLAS_OK(expr)                                                                  \
  do {                                                                                        \
    cublasStatus_t st_ = (expr);                                                              \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      std::fprintf(stderr, "%s:%d: cuBLAS error %d: %s\n", __FILE__, __LINE__, int(st_), #expr); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)
#define LAUNCH_CHECK() MOAT_CUDA_OK(cudaGetLastError())

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;

int blocks_for(int64_t n) { return static_cast<int>((n + kBlock - 1) / kBlock); }

// Grow-only device scratch.
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  void* get(size_t need) {
    if (need > bytes) {
      if (p) MOAT_CUDA_OK(cudaFree(p));
      MOAT_CUDA_OK(cudaMalloc(&p, need));
      bytes = need;
    }
    return p;
  }
};

int multiprocessors() {
  static const int count = [] {
    int n = 0;
    MOAT_CUDA_OK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0));
    return n;
  }();
  return count;
}

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide reductions for kBlock threads; every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float part[kWarps];
  __syncthreads();
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < kWarps; ++i) s += part[i];
  return s;
}
__device__ float block_max(float v) {
  __shared__ float part[kWarps];
  __syncthreads();
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int i = 0; i < kWarps; ++i) m = fmaxf(m, part[i]);
  return m;
}
__device__ double block_sum_d(double v) {
  __shared__ double part[kWarps];
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  for (int i = 0; i < kWarps; ++i) s += part[i];
  return s;
}

__device__ float fp8_e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  const float mag = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(static_cast<float>(8 + m), e - 10);
  return (b & 0x80) ? -mag : mag;
}

__device__ float load_weight(const void* data, int dtype, int64_t i) {
  switch (dtype) {
    case 0: return static_cast<const float*>(data)[i];
    case 1: return __half2float(static_cast<const __half*>(data)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
  }
}
int dtype_code(DType d) { return d == DType::F32 ? 0 : d == DType::F16 ? 1 : 2; }

// ---- embedding ---------------------------------------------------------------------------------
__global__ void embedding_kernel(const void* table, int dtype, const int32_t* ids, int64_t H, float* out) {
  const int64_t t = blockIdx.x;
  const int64_t row = ids[t];
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) out[t * H + j] = load_weight(table, dtype, row * H + j);
}

// ---- matmul ------------------------------------------------------------------------------------
__global__ void to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16_rn(x[i]);
}
__global__ void dequant_kernel(const void* data, int is_fp8, const float* scale_inv, int64_t N, int64_t K,
                               int64_t bo, int64_t bi, __nv_bfloat16* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= N * K) return;
  float v;
  if (is_fp8) {
    const int64_t n = i / K, k = i % K;
    v = fp8_e4m3_value(static_cast<const uint8_t*>(data)[i]) * scale_inv[(n / bo) * ((K + bi - 1) / bi) + k / bi];
  } else {
    v = __half2float(static_cast<const __half*>(data)[i]);
  }
  out[i] = __float2bfloat16_rn(v);
}

// The same dequantization 8 weights a thread (one 8- or 16-byte load, one 16-byte store, one
// row/column division per 8 instead of per weight): the per-weight kernel above moved fp8 at
// ~125 GB/s on an H200, 3% of its copy bandwidth. Needs K % 8 == 0 and 16-byte aligned rows.
__global__ void dequant8_kernel(const void* data, int is_fp8, const float* scale_inv, int64_t N, int64_t K,
                                int64_t bo, int64_t bi, __nv_bfloat16* out) {
  const int64_t groups_per_row = K / 8;
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= N * groups_per_row) return;
  const int64_t n = g / groups_per_row, k = (g - n * groups_per_row) * 8;
  __nv_bfloat16 v[8];
  if (is_fp8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(data) + n * K + k);
    // A group of 8 never straddles a scale block: bi % 8 == 0 (checked by the caller).
    const float scale = scale_inv[(n / bo) * ((K + bi - 1) / bi) + k / bi];
    const uint32_t words[2] = {raw.x, raw.y};
    for (int w = 0; w < 2; ++w)
      for (int b = 0; b < 4; ++b)
        v[4 * w + b] = __float2bfloat16_rn(fp8_e4m3_value(static_cast<uint8_t>(words[w] >> (8 * b))) * scale);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __half*>(data) + n * K + k);
    const __half* h = reinterpret_cast<const __half*>(&raw);
    for (int j = 0; j < 8; ++j) v[j] = __float2bfloat16_rn(__half2float(h[j]));
  }
  *reinterpret_cast<uint4*>(out + n * K + k) = *reinterpret_cast<const uint4*>(v);
}

// ---- decode GEMV (T <= kGemvMaxTokens) ---------------------------------------------------------
// A decode-sized call through cuBLAS costs a rounding kernel, the GEMM and, for fp8, a dequantized
// bf16 copy of the whole matrix: 5 bytes moved per fp8 weight instead of 1 (3% of an H200's copy
// bandwidth at T = 1), and 23-48% of it for the smaller bf16 projections (q_a + kv_a, q_b). This
// kernel streams the weights once: each warp owns kGemvRows rows; each lane loads 16 bytes of each
// row per chunk (8 bf16 or 16 fp8 codes), kGemvUnroll chunks ahead, and multiplies them with the
// fp32 x values under them (x is read kGemvRows times less than the weights); the warp sums its
// lanes at the end. fp32 arithmetic throughout: x is not rounded to bf16 here.
constexpr int kGemvRows = 2;
constexpr int kGemvUnroll = 4;
constexpr int kGemvMaxTokens = 8;
constexpr int kGemvWarps = 8;

// Two bf16 values in a 32-bit word (the lower address in the low half) as fp32: exact.
__device__ inline float2 bf16x2_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// Four e4m3 codes in a 32-bit word (lowest address first) as fp32. e4m3 -> half is exact (every
// e4m3 value is an fp16 value); sm_89+ converts a pair in one instruction.
__device__ inline void fp8x4_to_float(uint32_t w, float* out) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * p)), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    out[2 * p] = f.x;
    out[2 * p + 1] = f.y;
  }
}

__device__ inline void bf16x8_to_float(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = bf16x2_to_float2(w[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ inline void fp8x16_to_float(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) fp8x4_to_float(w[i], out + 4 * i);
}

// Warps split K `ksplit` ways when the rows alone would not fill the GPU (q_a + kv_a's 2112 rows
// gave one block per multiprocessor and 41% of the bandwidth): a block then holds
// kGemvWarps / ksplit row pairs, and the partial sums meet in shared memory.
template <int kT, bool kFp8>
__device__ __forceinline__ void gemv_block(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                           const float* __restrict__ scale_inv, int64_t N, int64_t K,
                                           int64_t scale_cols, int64_t bo, int64_t bi, int ksplit,
                                           float* __restrict__ y) {
  constexpr int kElems = kFp8 ? 16 : 8;  // weights per 16-byte load
  constexpr int kWeightBytes = kFp8 ? 1 : 2;
  __shared__ float partial[kGemvWarps][kGemvRows][kT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % ksplit;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * (kGemvWarps / ksplit) + warp / ksplit) * kGemvRows;
  const int64_t chunks = K / kElems, per_part = (chunks + ksplit - 1) / ksplit;
  const int64_t c_begin = min(chunks, part * per_part), c_end = min(chunks, c_begin + per_part);
  float acc[kGemvRows][kT];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int t = 0; t < kT; ++t) acc[r][t] = 0.0f;
  // rows past N read row N - 1 again and are never written (no early exit: the block meets below)
  const uint8_t* rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) rows[r] = w + min(n0 + r, N - 1) * K * kWeightBytes;
  for (int64_t c0 = c_begin; c0 < c_end; c0 += 32 * kGemvUnroll) {
    uint4 raw[kGemvUnroll][kGemvRows];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int64_t c = c0 + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r)
        raw[u][r] = c < c_end ? __ldcs(reinterpret_cast<const uint4*>(rows[r]) + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int64_t c = c0 + u * 32 + lane;
      if (c >= c_end) break;
      const int64_t k = c * kElems;
      float wf[kGemvRows][kElems];
      float scale[kGemvRows];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if constexpr (kFp8) {
          fp8x16_to_float(raw[u][r], wf[r]);
          scale[r] = scale_inv[(min(n0 + r, N - 1) / bo) * scale_cols + k / bi];
        } else {
          bf16x8_to_float(raw[u][r], wf[r]);
        }
      }
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        const float4* xv = reinterpret_cast<const float4*>(x + t * K + k);
        float xs[kElems];
#pragma unroll
        for (int j = 0; j < kElems / 4; ++j) {
          const float4 v = __ldg(xv + j);
          xs[4 * j] = v.x, xs[4 * j + 1] = v.y, xs[4 * j + 2] = v.z, xs[4 * j + 3] = v.w;
        }
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < kElems; ++j) dot = fmaf(xs[j], wf[r][j], dot);
          acc[r][t] = kFp8 ? fmaf(dot, scale[r], acc[r][t]) : acc[r][t] + dot;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0) partial[warp][r][t] = v;
    }
  __syncthreads();
  if (part != 0 || lane >= kGemvRows * kT) return;
  const int r = lane / kT, t = lane % kT;
  if (n0 + r >= N) return;
  float v = 0.0f;
  for (int p = 0; p < ksplit; ++p) v += partial[warp + p][r][t];
  y[t * N + n0 + r] = v;
}

template <int kT, bool kFp8>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const float* __restrict__ x, const uint8_t* __restrict__ w,
                                                              const float* __restrict__ scale_inv, int64_t N, int64_t K,
                                                              int64_t scale_cols, int64_t bo, int64_t bi, int ksplit,
                                                              float* __restrict__ y) {
  gemv_block<kT, kFp8>(x, w, scale_inv, N, K, scale_cols, bo, bi, ksplit, y);
}

// Many GEMVs of one shape in one launch (blockIdx.y picks the problem): a MoE layer's experts that
// got the same number of rows. One launch per expert matmul left a T = 1 layer (8 experts x gate,
// up, down) at 49% of an H200's copy bandwidth, much of it launch gaps between 15-30 us kernels.
struct GemvProblem {
  const uint8_t* w;
  const float* scale_inv;  // fp8 only
  const float* x;          // [kT, K]
  float* y;                // [kT, N]
};

template <int kT, bool kFp8>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_grouped_kernel(const GemvProblem* __restrict__ problems, int64_t N,
                                                                      int64_t K, int64_t scale_cols, int64_t bo,
                                                                      int64_t bi, int ksplit) {
  const GemvProblem p = problems[blockIdx.y];
  gemv_block<kT, kFp8>(p.x, p.w, p.scale_inv, N, K, scale_cols, bo, bi, ksplit, p.y);
}

// Warps that split K for `problems` GEMVs of N x K: enough for ~32 per multiprocessor, each part
// of K at least one pass of the warp.
int gemv_ksplit(int64_t N, int64_t K, bool fp8, int64_t problems) {
  const int64_t pairs = problems * ((N + kGemvRows - 1) / kGemvRows), chunks = K / (fp8 ? 16 : 8);
  int ksplit = 1;
  while (ksplit < kGemvWarps && pairs * ksplit < 32 * static_cast<int64_t>(multiprocessors()) &&
         chunks / (2 * ksplit) >= 32)
    ksplit *= 2;
  return ksplit;
}

// Calls fn(kT, kFp8) with T (1..kGemvMaxTokens) and fp8 as compile-time constants: the GEMV
// kernels are instantiated per token count and weight type.
template <class Fn>
void with_gemv_variant(int64_t T, bool fp8, Fn&& fn) {
  auto by_type = [&](auto kt) {
    if (fp8)
      fn(kt, std::true_type{});
    else
      fn(kt, std::false_type{});
  };
  switch (T) {
    case 1: by_type(std::integral_constant<int, 1>{}); break;
    case 2: by_type(std::integral_constant<int, 2>{}); break;
    case 3: by_type(std::integral_constant<int, 3>{}); break;
    case 4: by_type(std::integral_constant<int, 4>{}); break;
    case 5: by_type(std::integral_constant<int, 5>{}); break;
    case 6: by_type(std::integral_constant<int, 6>{}); break;
    case 7: by_type(std::integral_constant<int, 7>{}); break;
    case 8: by_type(std::integral_constant<int, 8>{}); break;
    default: std::abort();
  }
}

// y[T, N] = x[T, K] . W^T for one matrix (T <= kGemvMaxTokens, bf16 or fp8).
void launch_gemv(const float* x, int64_t T, const WeightMatrix& w, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  const bool fp8 = w.dtype == DType::F8_E4M3;
  const int ksplit = gemv_ksplit(N, K, fp8, 1);
  const int64_t rows_per_block = kGemvRows * (kGemvWarps / ksplit);
  const unsigned blocks = static_cast<unsigned>((N + rows_per_block - 1) / rows_per_block);
  const auto* data = static_cast<const uint8_t*>(w.data);
  const int64_t sc = w.scale_cols();
  with_gemv_variant(T, fp8, [&](auto kt, auto kfp8) {
    gemv_kernel<decltype(kt)::value, decltype(kfp8)::value>
        <<<blocks, kGemvWarps * 32>>>(x, data, w.scale_inv, N, K, sc, w.block_out, w.block_in, ksplit, y);
  });
}

// `count` problems (device array) of T rows each against N x K matrices of w's dtype and blocks.
void launch_gemv_grouped(const GemvProblem* problems, int64_t count, int64_t T, const WeightMatrix& w) {
  const int64_t N = w.out_features, K = w.in_features;
  const bool fp8 = w.dtype == DType::F8_E4M3;
  const int ksplit = gemv_ksplit(N, K, fp8, count);
  const int64_t rows_per_block = kGemvRows * (kGemvWarps / ksplit);
  const dim3 grid(static_cast<unsigned>((N + rows_per_block - 1) / rows_per_block), static_cast<unsigned>(count));
  const int64_t sc = w.scale_cols();
  with_gemv_variant(T, fp8, [&](auto kt, auto kfp8) {
    gemv_grouped_kernel<decltype(kt)::value, decltype(kfp8)::value>
        <<<grid, kGemvWarps * 32>>>(problems, N, K, sc, w.block_out, w.block_in, ksplit);
  });
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether launch_gemv takes this call: decode-sized, bf16 or fp8 with whole 16-byte chunks per row
// (and fp8 chunks inside one scale block), everything 16-byte aligned.
bool gemv_applies(const float* x, int64_t T, const WeightMatrix& w) {
  if (T < 1 || T > kGemvMaxTokens || !aligned16(x) || !aligned16(w.data)) return false;
  if (w.dtype == DType::BF16) return w.in_features % 8 == 0;
  if (w.dtype == DType::F8_E4M3) return w.in_features % 16 == 0 && w.block_in % 16 == 0;
  return false;
}

// cuBLAS is opened on first use rather than linked: libcublasLt alone maps hundreds of MB at
// process start, which every CPU-only run of moat would pay in RSS (the kernel issue's memory
// target is checkpoint + KV pool, nothing else).
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  // Spelled out: cublasGemmEx is overloaded in C++, so decltype cannot name it.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

const CublasApi& cublas_api() {
  static const CublasApi api = [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!lib) {
      std::fprintf(stderr, "moat: the cuda backend needs cuBLAS (libcublas.so.13): %s\n", dlerror());
      std::abort();
    }
    CublasApi a;
    a.create = reinterpret_cast<decltype(a.create)>(dlsym(lib, "cublasCreate_v2"));
    a.sgemm = reinterpret_cast<decltype(a.sgemm)>(dlsym(lib, "cublasSgemm_v2"));
    a.gemm_ex = reinterpret_cast<decltype(a.gemm_ex)>(dlsym(lib, "cublasGemmEx"));
    if (!a.create || !a.sgemm || !a.gemm_ex) {
      std::fprintf(stderr, "moat: libcublas lacks cublasCreate_v2/cublasSgemm_v2/cublasGemmEx\n");
      std::abort();
    }
    return a;
  }();
  return api;
}

cublasHandle_t cublas() {
  static cublasHandle_t handle = [] {
    cublasHandle_t h;
    MOAT_CUBLAS_OK(cublas_api().create(&h));
    return h;
  }();
  return handle;
}

// ---- rms_norm, rope, elementwise ---------------------------------------------------------------
__global__ void rms_norm_kernel(const float* x, const float* w, int64_t dim, float eps, float* y) {
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(dim) + eps);
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) yr[j] = xr[j] * inv * w[j];
}

__global__ void rope_kernel(RopeArgs a) {
  const int64_t t = blockIdx.x, h = blockIdx.y, half = a.rope_dim / 2;
  const float* c = a.cos_table + static_cast<int64_t>(a.positions[t]) * half;
  const float* s = a.sin_table + static_cast<int64_t>(a.positions[t]) * half;
  float* v = a.x + t * a.token_stride + h * a.head_stride;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * c[i] - x1 * s[i];
    v[2 * i + 1] = x0 * s[i] + x1 * c[i];
  }
}

__global__ void silu_mul_kernel(const float* g, const float* u, int64_t n, float* y) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
__global__ void add_scaled_kernel(float* y, const float* x, float alpha, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] += alpha * x[i];
}

// ---- paged latent cache -----------------------------------------------------------------------
// Conversions bit-identical to the reference's (dtype.h f32_to_bf16 / f32_to_fp8_e4m3), written
// out rather than taken from cuda_bf16.h / cuda_fp8.h so NaN payloads and ties match the host
// kernels exactly, and with explicit _rn intrinsics so no flag turns them into fast math.
__device__ uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// Round to nearest even, saturate to +-448, NaN -> 0x7f. Normals (|x| >= 2^-6) round the fp32
// mantissa to 3 bits in place and rebias the exponent (127 -> 7); subnormals are multiples of
// 2^-9, rounded by adding 2^23.
__device__ uint8_t f32_to_fp8_bits(float x) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7f;
  const float a = __uint_as_float(mag);
  uint32_t code;
  if (a >= 448.0f) code = 0x7e;
  else if (a >= 0x1p-6f) code = ((mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
  else code = __float_as_uint(__fadd_rn(__fmul_rn(a, 512.0f), 0x1p23f)) - __float_as_uint(0x1p23f);
  return static_cast<uint8_t>(code | sign);
}

// Element d of cache row `slot` as fp32 (fp8: times the row's scale, as read_latent_row does).
template <int kKv>  // 0 F32, 1 BF16, 2 F8_E4M3
__device__ float latent_value(const LatentPages& c, int64_t slot, int64_t D, int64_t d) {
  if constexpr (kKv == 0) return static_cast<const float*>(c.rows)[slot * D + d];
  if constexpr (kKv == 1) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(c.rows)[slot * D + d]) << 16);
  if constexpr (kKv == 2) return __fmul_rn(fp8_e4m3_value(static_cast<const uint8_t*>(c.rows)[slot * D + d]), c.row_scale[slot]);
  return 0.0f;
}

int kv_code(DType d) { return d == DType::F32 ? 0 : d == DType::BF16 ? 1 : 2; }

// One block per token: fp8 needs the row's max before any value is written.
__global__ void store_latent_kernel(StoreLatentArgs a) {
  const int64_t t = blockIdx.x, D = a.dim, slot = a.slot_mapping[t];
  if (slot < 0) return;  // the whole block: no thread reaches block_max
  const float* src = a.rows + t * D;  // [D]
  const LatentPages& c = a.cache;
  if (c.dtype == DType::F32) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) static_cast<float*>(c.rows)[slot * D + d] = src[d];
  } else if (c.dtype == DType::BF16) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      static_cast<uint16_t*>(c.rows)[slot * D + d] = f32_to_bf16_bits(src[d]);
  } else {
    float amax = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) amax = fmaxf(amax, fabsf(src[d]));
    amax = block_max(amax);
    const float scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      static_cast<uint8_t*>(c.rows)[slot * D + d] = f32_to_fp8_bits(__fdiv_rn(src[d], scale));
    if (threadIdx.x == 0) c.row_scale[slot] = scale;
  }
}

// ---- MLA attention -----------------------------------------------------------------------------
constexpr int kMaxPerLane = static_cast<int>(kMaxHeadDim / 32);

template <int kKv>
__global__ void mla_attention_kernel(MlaAttentionArgs a) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t D = a.kv_lora + a.rope_dim, C = a.kv_lora, B = a.cache.block_size;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* q = a.q + (t * a.num_heads + h) * D;
  const int32_t* blocks = a.block_tables + static_cast<int64_t>(a.token_seq[t]) * a.max_blocks_per_seq;
  const int64_t L = a.kv_len[t];
  // Each warp: online softmax over rows warp, warp + kWarps, ...; lane holds out[lane + 32 i].
  float m = -INFINITY, s = 0.0f, acc[kMaxPerLane];
  for (int i = 0; i < kMaxPerLane; ++i) acc[i] = 0.0f;
  for (int64_t j = warp; j < L; j += kWarps) {
    const int64_t slot = static_cast<int64_t>(blocks[j / B]) * B + j % B;
    float dot = 0.0f;
    for (int64_t d = lane; d < D; d += 32) dot += q[d] * latent_value<kKv>(a.cache, slot, D, d);
    const float score = warp_sum(dot) * a.scale;
    const float m_new = fmaxf(m, score);
    const float correction = expf(m - m_new), p = expf(score - m_new);
    s = s * correction + p;
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < C) acc[i] = acc[i] * correction + p * latent_value<kKv>(a.cache, slot, D, d);
    }
    m = m_new;
  }
  // merge the warps
  __shared__ float wm[kWarps], ws[kWarps];
  extern __shared__ float wacc[];  // [kWarps, C]
  if (lane == 0) {
    wm[warp] = m;
    ws[warp] = s;
  }
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < C) wacc[warp * C + d] = acc[i];
  }
  __syncthreads();
  float gm = -INFINITY;
  for (int w = 0; w < kWarps; ++w) gm = fmaxf(gm, wm[w]);
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w)
    if (wm[w] > -INFINITY) total += ws[w] * expf(wm[w] - gm);
  float* out = a.out + (t * a.num_heads + h) * C;
  for (int64_t d = threadIdx.x; d < C; d += blockDim.x) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w)
      if (wm[w] > -INFINITY) v += wacc[w * C + d] * expf(wm[w] - gm);
    out[d] = v / total;
  }
}

// ---- MLA decode attention, flash-decoding over heads and context splits ------------------------
// The kernel above gives each (token, head) one block that walks every row alone, one row per warp
// at a time: on an H200 it read the cache at 1-26 GB/s (0-1% of the copy bandwidth; 840 ms for 64
// sequences of 32k rows at 128 heads). MLA's heads all read the same latent rows, so here one block
// takes up to 16 heads of a token over one split of its rows: each row is loaded once per block
// (the block's warps share it through L1) and used for 16 heads, and the context is cut into enough
// splits to fill the GPU; a second kernel merges the splits' (max, sum, unnormalized output)
// exactly as the online softmax does. Warp w takes heads 2w and 2w + 1, a half-warp per head; lane s
// of a half-warp owns elements 64 i + 4 s + j (j < 4) of q, of every row and of the output (V is the
// row's first kv_lora values, so the row's registers serve both products). fp32 throughout.
// Instantiated for DeepSeek-V3 / Kimi's kv_lora 512 + rope 64.
constexpr int kMlaHeadsPerBlock = 16;
constexpr int kMlaChunksD = 9;  // (512 + 64) / 64
constexpr int kMlaChunksC = 8;  // 512 / 64

// A cache row's raw bits for one lane (4 values of each of its kMlaChunksD chunks), loaded ahead
// of their use and converted to fp32 when used.
template <int kKv>
struct LatentRaw {
  using Word = std::conditional_t<kKv == 0, float4, std::conditional_t<kKv == 1, uint2, uint32_t>>;
  Word w[kMlaChunksD];
  float scale;  // fp8's row scale
};

template <int kKv>
__device__ inline void load_latent_raw(const LatentPages& c, int64_t slot, int s, LatentRaw<kKv>& raw) {
  constexpr int64_t D = 64 * kMlaChunksD;
  using Word = typename LatentRaw<kKv>::Word;
  const Word* row = reinterpret_cast<const Word*>(
      static_cast<const uint8_t*>(c.rows) + slot * D * (kKv == 0 ? 4 : kKv == 1 ? 2 : 1));
#pragma unroll
  for (int i = 0; i < kMlaChunksD; ++i) raw.w[i] = __ldg(row + 16 * i + s);  // elements 64 i + 4 s ..
  if constexpr (kKv == 2) raw.scale = __ldg(c.row_scale + slot);
}

template <int kKv>
__device__ inline void latent_to_float(const LatentRaw<kKv>& raw, int i, float* out) {
  if constexpr (kKv == 0) {
    out[0] = raw.w[i].x, out[1] = raw.w[i].y, out[2] = raw.w[i].z, out[3] = raw.w[i].w;
  } else if constexpr (kKv == 1) {
    const float2 lo = bf16x2_to_float2(raw.w[i].x), hi = bf16x2_to_float2(raw.w[i].y);
    out[0] = lo.x, out[1] = lo.y, out[2] = hi.x, out[3] = hi.y;
  } else {
    fp8x4_to_float(raw.w[i], out);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = __fmul_rn(out[e], raw.scale);
  }
}

// Rows a warp keeps in flight ahead of the one it multiplies: one row at a time left each warp
// waiting a full memory latency per row (16 heads, 64 x 32k rows: 8% of the copy bandwidth). The
// registers hold kMlaLookahead rows; rows further ahead, up to kMlaPrefetch, are asked into L2
// only (no registers). H200, 64 sequences x 32k rows, bf16, 128 / 16 heads: no row ahead 54.6 /
// 7.8 ms; two rows ahead (161 registers a thread, one block per multiprocessor) 65.9 / 8.8 ms; one
// row ahead held to 128 registers (two blocks) 43.1 / 5.8 ms.
constexpr int kMlaLookahead = 1;
constexpr int kMlaPrefetch = 8;

__device__ inline void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Walks a sequence's rows through its block table without a division per row.
struct RowCursor {
  const int32_t* blocks;
  int64_t block_size, block_index, offset;
  __device__ RowCursor(const int32_t* b, int64_t B, int64_t j) : blocks(b), block_size(B), block_index(j / B), offset(j % B) {}
  __device__ int64_t next_slot() {
    const int64_t slot = static_cast<int64_t>(blocks[block_index]) * block_size + offset;
    if (++offset == block_size) offset = 0, ++block_index;
    return slot;
  }
};

// part_out [T, splits, H, C] unnormalized; part_ml [T, splits, H, 2] (running max, sum of exp).
template <int kKv>
__global__ void __launch_bounds__(kMlaHeadsPerBlock * 16, 2) mla_decode_split_kernel(MlaAttentionArgs a, int64_t splits,
                                                                                 float* part_out, float* part_ml) {
  constexpr int64_t D = 64 * kMlaChunksD, C = 64 * kMlaChunksC;
  const int64_t t = blockIdx.x, split = blockIdx.z, H = a.num_heads, B = a.cache.block_size;
  const int s = threadIdx.x & 15;
  const int64_t h = blockIdx.y * kMlaHeadsPerBlock + (threadIdx.x >> 4);
  // At least 64 rows a split: a short sequence leaves its last splits empty (max -inf, skipped).
  const int64_t L = a.kv_len[t], per = max(int64_t{64}, (L + splits - 1) / splits);
  const int64_t j0 = min(L, split * per), j1 = min(L, j0 + per);
  const int64_t part = (t * splits + split) * H + h;
  if (j0 == j1) {  // the merge reads no output of an empty split
    if (h < H && s == 0) part_ml[2 * part] = -INFINITY, part_ml[2 * part + 1] = 0.0f;
    return;
  }
  const int64_t hq = min(h, H - 1);  // a half-warp past the last head computes head H-1 again, unwritten
  float q[kMlaChunksD][4];
#pragma unroll
  for (int i = 0; i < kMlaChunksD; ++i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(a.q + (t * H + hq) * D + 64 * i + 4 * s));
    q[i][0] = v.x, q[i][1] = v.y, q[i][2] = v.z, q[i][3] = v.w;
  }
  const int32_t* blocks = a.block_tables + static_cast<int64_t>(a.token_seq[t]) * a.max_blocks_per_seq;
  float m = -INFINITY, l = 0.0f, acc[kMlaChunksC][4];
#pragma unroll
  for (int i = 0; i < kMlaChunksC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  RowCursor ahead(blocks, B, j0), far(blocks, B, j0 + kMlaLookahead);
  constexpr int64_t kRowBytes = D * (kKv == 0 ? 4 : kKv == 1 ? 2 : 1);
  const int lane = threadIdx.x & 31;
  auto prefetch_next_far = [&] {
    const auto* row = static_cast<const uint8_t*>(a.cache.rows) + far.next_slot() * kRowBytes;
    if (lane * 128 < kRowBytes) prefetch_l2(row + lane * 128);
  };
  for (int64_t j = j0 + kMlaLookahead; j < min(j1, j0 + kMlaPrefetch); ++j) prefetch_next_far();
  LatentRaw<kKv> raw[kMlaLookahead + 1];
#pragma unroll
  for (int r = 0; r < kMlaLookahead; ++r)
    if (j0 + r < j1) load_latent_raw<kKv>(a.cache, ahead.next_slot(), s, raw[r]);
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kMlaPrefetch < j1) prefetch_next_far();
    if (j + kMlaLookahead < j1) load_latent_raw<kKv>(a.cache, ahead.next_slot(), s, raw[kMlaLookahead]);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kMlaChunksD; ++i) {
      float v[4];
      latent_to_float<kKv>(raw[0], i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) dot = fmaf(q[i][e], v[e], dot);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);  // within the half-warp
    const float score = dot * a.scale;
    if (score > m) {  // the running max moves: rescale what was summed under the old one
      const float correction = expf(m - score);
      l *= correction;
#pragma unroll
      for (int i = 0; i < kMlaChunksC; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] *= correction;
      m = score;
    }
    const float p = expf(score - m);
    l += p;
#pragma unroll
    for (int i = 0; i < kMlaChunksC; ++i) {
      float v[4];
      latent_to_float<kKv>(raw[0], i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = fmaf(p, v[e], acc[i][e]);
    }
#pragma unroll
    for (int r = 0; r < kMlaLookahead; ++r) raw[r] = raw[r + 1];
  }
  if (h >= H) return;
  if (s == 0) part_ml[2 * part] = m, part_ml[2 * part + 1] = l;
#pragma unroll
  for (int i = 0; i < kMlaChunksC; ++i)
    *reinterpret_cast<float4*>(part_out + part * C + 64 * i + 4 * s) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

// One block of kBlock threads per (token, head): the splits' outputs rescaled to their common max,
// over their sum (max and sum reduced over the block: a thread walking 1000 splits alone cost
// ~0.1 ms at T = 1).
constexpr int64_t kMlaMaxSplits = 1024;

__global__ void mla_merge_kernel(const float* part_out, const float* part_ml, int64_t splits, int64_t H, int64_t C,
                                 float* out) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  __shared__ float factor[kMlaMaxSplits];  // exp(m_split - M) / total, 0 for an empty split
  const float* ml = part_ml + 2 * (t * splits * H + h);  // split sp at ml[2 * sp * H]
  float local_max = -INFINITY;
  for (int64_t sp = threadIdx.x; sp < splits; sp += blockDim.x) local_max = fmaxf(local_max, ml[2 * sp * H]);
  const float M = block_max(local_max);
  float local_sum = 0.0f;
  for (int64_t sp = threadIdx.x; sp < splits; sp += blockDim.x) {
    const float m = ml[2 * sp * H];
    const float f = m > -INFINITY ? expf(m - M) : 0.0f;
    factor[sp] = f;
    local_sum += ml[2 * sp * H + 1] * f;
  }
  const float inv_total = 1.0f / block_sum(local_sum);  // block_sum's barrier also publishes factor[]
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float v = 0.0f;
    for (int64_t sp = 0; sp < splits; ++sp)
      if (factor[sp] != 0.0f) v = fmaf(part_out[((t * splits + sp) * H + h) * C + c], factor[sp], v);
    out[(t * H + h) * C + c] = v * inv_total;
  }
}


// ---- MoE router (one thread block per token; thread 0 selects, mirroring the reference) --------
__global__ void moe_route_kernel(MoeRouteArgs a) {
  const int64_t t = blockIdx.x, E = a.num_experts;
  __shared__ float scores[kMaxExperts], choice[kMaxExperts];
  const float* logits = a.logits + t * E;
  if (a.sigmoid) {
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
  } else {
    float mx = -INFINITY;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, logits[e]);
    mx = block_max(mx);
    double sum = 0.0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) sum += expf(logits[e] - mx);
    sum = block_sum_d(sum);
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
      scores[e] = static_cast<float>(expf(logits[e] - mx) / sum);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + (a.bias ? a.bias[e] : 0.0f);
  if (a.group_limited && a.n_group > 1) {
    const int64_t per = E / a.n_group;
    float gscore[64];
    bool kept[64];
    for (int64_t g = 0; g < a.n_group; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;  // best two of the group (first index on ties)
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        const float v = choice[e];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      gscore[g] = a.group_score_top2_sum && per > 1 ? b1 + b2 : b1;
      kept[g] = false;
    }
    for (int64_t r = 0; r < a.topk_group; ++r) {
      int64_t best = -1;
      for (int64_t g = 0; g < a.n_group; ++g)
        if (!kept[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
      kept[best] = true;
    }
    for (int64_t e = 0; e < E; ++e)
      if (!kept[e / per]) choice[e] = -INFINITY;
  }
  int32_t ids[kMaxTopK];
  double sum = 0.0;
  for (int64_t i = 0; i < a.top_k; ++i) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t p = 0; p < i; ++p) taken |= ids[p] == e;
      if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
    }
    ids[i] = static_cast<int32_t>(best);
    sum += scores[best];
  }
  for (int64_t i = 0; i < a.top_k; ++i) {
    float w = scores[ids[i]];
    if (a.norm_topk_prob && a.top_k > 1) w = static_cast<float>(w / (sum + 1e-20));
    a.topk_ids[t * a.top_k + i] = ids[i];
    a.topk_weights[t * a.top_k + i] = w * a.routed_scaling_factor;
  }
}

// ---- softmax and sampling (one block per row) --------------------------------------------------
__global__ void softmax_kernel(const float* x, int64_t n, float temperature, float* probs) {
  const float* row = x + blockIdx.x * n;
  float* p = probs + blockIdx.x * n;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, row[i]);
  mx = block_max(mx);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += (p[i] = expf((row[i] - mx) / temperature));
  const float inv = 1.0f / block_sum(sum);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] *= inv;
}

__device__ void renormalize_row(float* p, int64_t n, float threshold) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (p[i] < threshold) p[i] = 0.0f;
    sum += p[i];
  }
  sum = block_sum_d(sum);
  const double denom = fmax(sum, 1e-8);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = static_cast<float>(p[i] / denom);
}

// Largest bit pattern b (a value threshold) with pred(b) true, where pred is monotone: true for
// small b. p >= 0, so comparing bit patterns as unsigned compares values.
template <typename Pred>
__device__ float largest_threshold(Pred pred) {
  uint32_t lo = 0, hi = 0x7f800000u;  // pred(lo) holds
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    if (pred(__uint_as_float(mid))) lo = mid;
    else hi = mid - 1;
  }
  return __uint_as_float(lo);
}

__global__ void top_k_kernel(float* probs, int64_t n, const int32_t* top_k) {
  float* p = probs + blockIdx.x * n;
  const int64_t k = top_k[blockIdx.x];
  float threshold = 0.0f;
  if (k > 0 && k < n) {
    // the k-th largest value: the largest v with count(p >= v) >= k (ties kept)
    threshold = largest_threshold([&](float v) {
      float c = 0.0f;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) c += p[i] >= v ? 1.0f : 0.0f;
      return block_sum(c) >= static_cast<float>(k);
    });
  }
  renormalize_row(p, n, threshold);
}

__global__ void top_p_kernel(float* probs, int64_t n, const float* top_p) {
  float* p = probs + blockIdx.x * n;
  const float tp = top_p[blockIdx.x];
  float threshold = 0.0f;
  if (tp < 1.0f) {
    double total = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) total += p[i];
    total = block_sum_d(total);
    const double target = static_cast<double>(tp) * total;
    // the largest v whose mass sum(p >= v) reaches top_p (ties kept)
    threshold = largest_threshold([&](float v) {
      double s = 0.0;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += p[i] >= v ? p[i] : 0.0f;
      return block_sum_d(s) >= target;
    });
  }
  renormalize_row(p, n, threshold);
}

__global__ void min_p_kernel(float* probs, int64_t n, const float* min_p) {
  float* p = probs + blockIdx.x * n;
  float mx = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, p[i]);
  mx = block_max(mx);
  renormalize_row(p, n, min_p[blockIdx.x] > 0.0f ? min_p[blockIdx.x] * mx : 0.0f);
}

// Each thread sums a contiguous chunk; the chunk where the running sum passes u * total is walked
// exactly like the reference walks the row.
__global__ void sample_kernel(const float* probs, int64_t n, const float* u, int32_t* out) {
  const float* p = probs + blockIdx.x * n;
  __shared__ double chunk_sum[kBlock];
  const int64_t per = (n + kBlock - 1) / kBlock;
  const int64_t b = threadIdx.x * per, e = min(n, b + per);
  double s = 0.0;
  for (int64_t i = b; i < e; ++i) s += p[i];
  chunk_sum[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0.0;
  for (int c = 0; c < kBlock; ++c) total += chunk_sum[c];
  const double target = static_cast<double>(u[blockIdx.x]) * total;
  double cum = 0.0;
  int32_t pick = -1;
  for (int c = 0; c < kBlock; ++c) {
    const int64_t cb = c * per, ce = min(n, cb + per);
    if (cb >= ce) break;
    if (cum + chunk_sum[c] <= target) {  // the crossing is not in this chunk
      for (int64_t i = ce - 1; i >= cb; --i)
        if (p[i] > 0.0f) {
          pick = static_cast<int32_t>(i);
          break;
        }
      cum += chunk_sum[c];
      continue;
    }
    for (int64_t i = cb; i < ce; ++i) {
      if (p[i] <= 0.0f) continue;
      pick = static_cast<int32_t>(i);
      cum += p[i];
      if (cum > target) break;
    }
    break;
  }
  out[blockIdx.x] = pick;
}

__global__ void argmax_kernel(const float* x, int64_t n, int32_t* out) {
  const float* row = x + blockIdx.x * n;
  float best = -INFINITY;
  int64_t idx = n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (row[i] > best) {
      best = row[i];
      idx = i;
    }
  __shared__ float sv[kBlock];
  __shared__ int64_t si[kBlock];
  sv[threadIdx.x] = best;
  si[threadIdx.x] = idx;
  __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float ov = sv[threadIdx.x + stride];
      const int64_t oi = si[threadIdx.x + stride];
      if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
        sv[threadIdx.x] = ov;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(si[0] < n ? si[0] : 0);
}

// ---- moe_experts -------------------------------------------------------------------------------
// grouped[row_of[i]] = x[i / K]: one block per routed row.
__global__ void moe_gather_kernel(const float* x, const int32_t* row_of, int64_t K, int64_t H, float* grouped) {
  const int64_t i = blockIdx.x;
  if (row_of[i] < 0) return;  // an expert another rank holds
  const float* src = x + (i / K) * H;
  float* dst = grouped + static_cast<int64_t>(row_of[i]) * H;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) dst[j] = src[j];
}
// out[t] += sum_k w[t, k] * y[row_of[t, k]], k in order: one block per token, no atomics.
__global__ void moe_combine_kernel(const float* y, const int32_t* row_of, const float* w, int64_t K, int64_t H,
                                   float* out) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    float acc = out[t * H + j];
    for (int64_t k = 0; k < K; ++k)
      if (row_of[t * K + k] >= 0) acc += w[t * K + k] * y[static_cast<int64_t>(row_of[t * K + k]) * H + j];
    out[t * H + j] = acc;
  }
}

MatmulFn inner_matmul(const InnerOps& inner, DType dtype) {
  MatmulFn fn = inner.matmul_by_dtype ? inner.matmul_by_dtype[static_cast<int>(dtype)] : nullptr;
  if (!fn) {
    std::fprintf(stderr, "cuda composite op: no matmul resolved for weight dtype %d\n", static_cast<int>(dtype));
    std::abort();
  }
  return fn;
}

}  // namespace

// ---- host side ---------------------------------------------------------------------------------

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  return true;
}

std::string device_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "?";
  return prop.name;
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  MOAT_CUDA_OK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
  return p;
}
void device_free(void* p) { MOAT_CUDA_OK(cudaFree(p)); }
void copy_to_device(void* dst, const void* src, size_t bytes) {
  MOAT_CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  MOAT_CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void synchronize() { MOAT_CUDA_OK(cudaDeviceSynchronize()); }

void embedding(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out) {
  if (T == 0) return;
  embedding_kernel<<<static_cast<int>(T), kBlock>>>(table.data, dtype_code(table.dtype), ids, table.in_features, out);
  LAUNCH_CHECK();
}

void matmul_cublas(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision&) {
  if (T == 0) return;
  const int64_t N = w.out_features, K = w.in_features;
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major y[T, N] = x[T, K] . W[N, K]^T is column-major y^T[N, T] = W^T(op T on [K, N]) . x^T.
  if (w.dtype == DType::F32) {
    MOAT_CUBLAS_OK(cublas_api().sgemm(cublas(), CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &alpha, static_cast<const float*>(w.data),
                               K, x, K, &beta, y, N));
    return;
  }
  if (gemv_applies(x, T, w)) {
    launch_gemv(x, T, w, y);
    LAUNCH_CHECK();
    return;
  }
  static Scratch xs, ws;
  auto* xb = static_cast<__nv_bfloat16*>(xs.get(sizeof(__nv_bfloat16) * T * K));
  to_bf16_kernel<<<blocks_for(T * K), kBlock>>>(x, T * K, xb);
  LAUNCH_CHECK();
  const void* wb = w.data;
  if (w.dtype == DType::F8_E4M3 || w.dtype == DType::F16) {
    auto* deq = static_cast<__nv_bfloat16*>(ws.get(sizeof(__nv_bfloat16) * N * K));
    const bool fp8 = w.dtype == DType::F8_E4M3;
    if (K % 8 == 0 && aligned16(w.data) && (!fp8 || w.block_in % 8 == 0))
      dequant8_kernel<<<blocks_for(N * K / 8), kBlock>>>(w.data, fp8, w.scale_inv, N, K, w.block_out, w.block_in, deq);
    else
      dequant_kernel<<<blocks_for(N * K), kBlock>>>(w.data, fp8, w.scale_inv, N, K, w.block_out, w.block_in, deq);
    LAUNCH_CHECK();
    wb = deq;
  }
  MOAT_CUBLAS_OK(cublas_api().gemm_ex(cublas(), CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &alpha, wb, CUDA_R_16BF, K, xb, CUDA_R_16BF,
                              K, &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void rms_norm(const float* x, const float* weight, int64_t T, int64_t dim, float eps, float* y) {
  if (T == 0) return;
  rms_norm_kernel<<<static_cast<int>(T), kBlock>>>(x, weight, dim, eps, y);
  LAUNCH_CHECK();
}

void rope(const RopeArgs& args) {
  if (args.num_tokens == 0 || args.num_heads == 0) return;
  rope_kernel<<<dim3(static_cast<unsigned>(args.num_tokens), static_cast<unsigned>(args.num_heads)), 64>>>(args);
  LAUNCH_CHECK();
}

void silu_mul(const float* gate, const float* up, int64_t T, int64_t n, float* y) {
  if (T * n == 0) return;
  silu_mul_kernel<<<blocks_for(T * n), kBlock>>>(gate, up, T * n, y);
  LAUNCH_CHECK();
}

void add_scaled(float* y, const float* x, float alpha, int64_t n) {
  if (n == 0) return;
  add_scaled_kernel<<<blocks_for(n), kBlock>>>(y, x, alpha, n);
  LAUNCH_CHECK();
}

void store_latent(const StoreLatentArgs& a) {
  if (a.num_tokens == 0) return;
  store_latent_kernel<<<static_cast<unsigned>(a.num_tokens), kBlock>>>(a);
  LAUNCH_CHECK();
}

void mla_attention(const MlaAttentionArgs& a) {
  if (a.num_tokens == 0) return;
  if (a.kv_lora == 64 * kMlaChunksC && a.rope_dim == 64 * (kMlaChunksD - kMlaChunksC) && aligned16(a.q) &&
      aligned16(a.cache.rows)) {
    // Splits per token: enough blocks for ~8 per multiprocessor. The lengths stay on the device (no
    // synchronization per layer), so a split whose rows a short sequence lacks runs empty.
    const int64_t T = a.num_tokens, H = a.num_heads, C = a.kv_lora;
    const int64_t groups = (H + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock;
    // The block table's width bounds every sequence's length: no more splits than its 64-row pieces.
    const int64_t want = (8 * static_cast<int64_t>(multiprocessors()) + T * groups - 1) / (T * groups);
    const int64_t most = (a.max_blocks_per_seq * a.cache.block_size + 63) / 64;
    const int64_t splits = std::clamp<int64_t>(std::min(want, most), 1, kMlaMaxSplits);
    static Scratch out_scratch, ml_scratch;
    auto* part_out = static_cast<float*>(out_scratch.get(sizeof(float) * T * splits * H * C));
    auto* part_ml = static_cast<float*>(ml_scratch.get(sizeof(float) * T * splits * H * 2));
    const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(groups), static_cast<unsigned>(splits));
    const unsigned threads = static_cast<unsigned>(16 * std::min<int64_t>(H + (H & 1), kMlaHeadsPerBlock));
    switch (kv_code(a.cache.dtype)) {
      case 0: mla_decode_split_kernel<0><<<grid, threads>>>(a, splits, part_out, part_ml); break;
      case 1: mla_decode_split_kernel<1><<<grid, threads>>>(a, splits, part_out, part_ml); break;
      default: mla_decode_split_kernel<2><<<grid, threads>>>(a, splits, part_out, part_ml); break;
    }
    LAUNCH_CHECK();
    mla_merge_kernel<<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(H)), kBlock>>>(part_out, part_ml, splits, H,
                                                                                           C, a.out);
    LAUNCH_CHECK();
    return;
  }
  const size_t shared = sizeof(float) * kWarps * a.kv_lora;
  const dim3 grid(static_cast<unsigned>(a.num_tokens), static_cast<unsigned>(a.num_heads));
  switch (kv_code(a.cache.dtype)) {
    case 0: mla_attention_kernel<0><<<grid, kBlock, shared>>>(a); break;
    case 1: mla_attention_kernel<1><<<grid, kBlock, shared>>>(a); break;
    default: mla_attention_kernel<2><<<grid, kBlock, shared>>>(a); break;
  }
  LAUNCH_CHECK();
}

void mla_attention_pad_heads(const MlaAttentionArgs& args, int64_t pad_to, MlaAttentionFn kernel) {
  const int64_t T = args.num_tokens, H = args.num_heads, D = args.kv_lora + args.rope_dim, C = args.kv_lora;
  if (T == 0) return;
  static Scratch q_scratch, out_scratch;
  auto* q = static_cast<float*>(q_scratch.get(sizeof(float) * T * pad_to * D));   // [T, pad_to, D]
  auto* out = static_cast<float*>(out_scratch.get(sizeof(float) * T * pad_to * C));  // [T, pad_to, C]
  MOAT_CUDA_OK(cudaMemsetAsync(q, 0, sizeof(float) * T * pad_to * D));
  MOAT_CUDA_OK(cudaMemcpy2DAsync(q, sizeof(float) * pad_to * D, args.q, sizeof(float) * H * D, sizeof(float) * H * D, T,
                                 cudaMemcpyDeviceToDevice));
  MlaAttentionArgs padded = args;
  padded.q = q;
  padded.num_heads = pad_to;
  padded.out = out;
  kernel(padded);
  MOAT_CUDA_OK(cudaMemcpy2DAsync(args.out, sizeof(float) * H * C, out, sizeof(float) * pad_to * C, sizeof(float) * H * C,
                                 T, cudaMemcpyDeviceToDevice));
}

void moe_route(const MoeRouteArgs& a) {
  if (a.num_tokens == 0) return;
  if (a.n_group > 64 || a.num_experts > kMaxExperts || a.top_k > kMaxTopK) {
    std::fprintf(stderr, "cuda.moe_route: n_group %lld > 64, experts %lld > %lld or top_k %lld > %lld\n",
                 static_cast<long long>(a.n_group), static_cast<long long>(a.num_experts),
                 static_cast<long long>(kMaxExperts), static_cast<long long>(a.top_k), static_cast<long long>(kMaxTopK));
    std::abort();
  }
  moe_route_kernel<<<static_cast<int>(a.num_tokens), kBlock>>>(a);
  LAUNCH_CHECK();
}

void softmax(const float* x, int64_t T, int64_t n, float temperature, float* probs) {
  if (T == 0) return;
  softmax_kernel<<<static_cast<int>(T), kBlock>>>(x, n, temperature, probs);
  LAUNCH_CHECK();
}
void top_k_renorm_prob(float* probs, int64_t T, int64_t n, const int32_t* top_k) {
  if (T == 0) return;
  top_k_kernel<<<static_cast<int>(T), kBlock>>>(probs, n, top_k);
  LAUNCH_CHECK();
}
void top_p_renorm_prob(float* probs, int64_t T, int64_t n, const float* top_p) {
  if (T == 0) return;
  top_p_kernel<<<static_cast<int>(T), kBlock>>>(probs, n, top_p);
  LAUNCH_CHECK();
}
void min_p_renorm_prob(float* probs, int64_t T, int64_t n, const float* min_p) {
  if (T == 0) return;
  min_p_kernel<<<static_cast<int>(T), kBlock>>>(probs, n, min_p);
  LAUNCH_CHECK();
}
void sample_from_probs(const float* probs, int64_t T, int64_t n, const float* u, int32_t* out) {
  if (T == 0) return;
  sample_kernel<<<static_cast<int>(T), kBlock>>>(probs, n, u, out);
  LAUNCH_CHECK();
}
void argmax(const float* x, int64_t T, int64_t n, int32_t* out) {
  if (T == 0) return;
  argmax_kernel<<<static_cast<int>(T), kBlock>>>(x, n, out);
  LAUNCH_CHECK();
}

void moe_experts(const MoeExpertsArgs& a, const InnerOps& inner) {
  const int64_t T = a.num_tokens, H = a.hidden, K = a.top_k, E = a.num_experts, I = a.intermediate, R = T * K;
  if (R == 0) return;
  if (a.activation == GatedActivation::situ && inner.situ_mul == nullptr) {
    std::fprintf(stderr, "cuda.moe_experts: the SiTU activation needs InnerOps::situ_mul (ModelOpNeeds::k3_ops)\n");
    std::abort();
  }
  // Group rows by expert on the host (counting sort of the ids read back), so each expert runs
  // one matmul over all its rows.
  std::vector<int32_t> ids(static_cast<size_t>(R)), row_of(static_cast<size_t>(R));
  MOAT_CUDA_OK(cudaMemcpy(ids.data(), a.topk_ids, sizeof(int32_t) * R, cudaMemcpyDeviceToHost));
  std::vector<int64_t> begin(static_cast<size_t>(E + 1), 0);
  for (int32_t e : ids) {
    if (e == -1) continue;  // an expert another rank holds (expert parallelism)
    if (e < 0 || e >= E) {
      std::fprintf(stderr, "cuda.moe_experts: expert id %d outside %lld experts\n", e, static_cast<long long>(E));
      std::abort();
    }
    ++begin[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
  std::vector<int64_t> fill(begin.begin(), begin.end() - 1);
  for (int64_t i = 0; i < R; ++i) row_of[i] = ids[i] == -1 ? -1 : static_cast<int32_t>(fill[ids[i]]++);
  static Scratch row_scratch, in_scratch, out_scratch, gate_scratch, up_scratch;
  auto* d_row_of = static_cast<int32_t*>(row_scratch.get(sizeof(int32_t) * R));
  auto* in = static_cast<float*>(in_scratch.get(sizeof(float) * R * H));     // [R, H] grouped x
  auto* out = static_cast<float*>(out_scratch.get(sizeof(float) * R * H));   // [R, H] expert outputs
  auto* gate = static_cast<float*>(gate_scratch.get(sizeof(float) * R * I));  // [R, I]
  auto* up = static_cast<float*>(up_scratch.get(sizeof(float) * R * I));      // [R, I]
  MOAT_CUDA_OK(cudaMemcpy(d_row_of, row_of.data(), sizeof(int32_t) * R, cudaMemcpyHostToDevice));
  moe_gather_kernel<<<static_cast<unsigned>(R), kBlock>>>(a.x, d_row_of, K, H, in);
  LAUNCH_CHECK();
  // Experts of at most kGemvMaxTokens rows whose three matrices the decode GEMV takes (the inner
  // matmul is this backend's, bf16 or fp8, aligned) run grouped by row count: one launch for the
  // gate and up of every expert with c rows, one for their down. The rest run a matmul each.
  const int64_t valid_rows = begin[E];
  // One launch serves one dtype and one set of fp8 blocks: the first groupable expert's. Experts
  // that differ (no published checkpoint mixes them) run a matmul each.
  const MlpWeights* pattern = nullptr;
  auto groupable = [&](const MlpWeights& w) {
    const WeightMatrix* m[3] = {&w.gate_proj, &w.up_proj, &w.down_proj};
    const WeightMatrix& like = pattern ? pattern->gate_proj : w.gate_proj;
    for (const WeightMatrix* x : m)
      if (inner_matmul(inner, x->dtype) != &matmul_cublas || x->dtype != like.dtype || !gemv_applies(in, 1, *x) ||
          x->block_out != like.block_out || x->block_in != like.block_in)
        return false;
    return H % 4 == 0 && I % 4 == 0;  // every expert's x and y rows 16-byte aligned
  };
  std::vector<GemvProblem> gate_up[kGemvMaxTokens + 1], down[kGemvMaxTokens + 1];
  std::vector<bool> grouped(static_cast<size_t>(E), false);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t row0 = begin[e], rows = begin[e + 1] - row0;
    if (rows == 0) continue;
    const MlpWeights& w = a.experts[e];
    if (rows <= kGemvMaxTokens && groupable(w)) {
      if (!pattern) pattern = &w;
      grouped[static_cast<size_t>(e)] = true;
      auto data = [](const WeightMatrix& m) { return static_cast<const uint8_t*>(m.data); };
      gate_up[rows].push_back({data(w.gate_proj), w.gate_proj.scale_inv, in + row0 * H, gate + row0 * I});
      gate_up[rows].push_back({data(w.up_proj), w.up_proj.scale_inv, in + row0 * H, up + row0 * I});
      down[rows].push_back({data(w.down_proj), w.down_proj.scale_inv, gate + row0 * I, out + row0 * H});
      continue;
    }
    inner_matmul(inner, w.gate_proj.dtype)(in + row0 * H, rows, w.gate_proj, gate + row0 * I, inner.precision);
    inner_matmul(inner, w.up_proj.dtype)(in + row0 * H, rows, w.up_proj, up + row0 * I, inner.precision);
  }
  // All problems in one copy: gate/up lists for c = 1..8, then down lists.
  std::vector<GemvProblem> all;
  int64_t gate_up_at[kGemvMaxTokens + 1], down_at[kGemvMaxTokens + 1];
  for (int c = 1; c <= kGemvMaxTokens; ++c) {
    gate_up_at[c] = static_cast<int64_t>(all.size());
    all.insert(all.end(), gate_up[c].begin(), gate_up[c].end());
  }
  for (int c = 1; c <= kGemvMaxTokens; ++c) {
    down_at[c] = static_cast<int64_t>(all.size());
    all.insert(all.end(), down[c].begin(), down[c].end());
  }
  static Scratch problem_scratch;
  auto* d_problems = static_cast<GemvProblem*>(problem_scratch.get(sizeof(GemvProblem) * std::max<size_t>(all.size(), 1)));
  if (!all.empty()) {
    MOAT_CUDA_OK(cudaMemcpy(d_problems, all.data(), sizeof(GemvProblem) * all.size(), cudaMemcpyHostToDevice));
    for (int c = 1; c <= kGemvMaxTokens; ++c)
      if (!gate_up[c].empty())
        launch_gemv_grouped(d_problems + gate_up_at[c], static_cast<int64_t>(gate_up[c].size()), c, pattern->gate_proj);
    LAUNCH_CHECK();
  }
  // The activation over every routed row at once, grouped or not (rows for experts on other ranks
  // were never gathered).
  if (a.activation == GatedActivation::situ)  // Kimi K3 (k3_kernels.cu)
    inner.situ_mul(gate, up, valid_rows, I, a.situ_beta, a.situ_linear_beta, gate);
  else
    inner.silu_mul(gate, up, valid_rows, I, gate);
  if (!all.empty()) {
    for (int c = 1; c <= kGemvMaxTokens; ++c)
      if (!down[c].empty())
        launch_gemv_grouped(d_problems + down_at[c], static_cast<int64_t>(down[c].size()), c, pattern->down_proj);
    LAUNCH_CHECK();
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t row0 = begin[e], rows = begin[e + 1] - row0;
    if (rows == 0 || grouped[static_cast<size_t>(e)]) continue;
    const MlpWeights& w = a.experts[e];
    inner_matmul(inner, w.down_proj.dtype)(gate + row0 * I, rows, w.down_proj, out + row0 * H, inner.precision);
  }
  moe_combine_kernel<<<static_cast<unsigned>(T), kBlock>>>(out, d_row_of, a.topk_weights, K, H, a.out);
  LAUNCH_CHECK();
}

void head_matmul(const HeadMatmulArgs& a, const InnerOps& inner) {
  const int64_t T = a.num_tokens;
  if (T == 0 || a.num_heads == 0) return;
  const int64_t in = a.weights[0].in_features, out = a.weights[0].out_features;
  static Scratch x_scratch, y_scratch;
  auto* xs = static_cast<float*>(x_scratch.get(sizeof(float) * T * in));   // [T, in] one head's rows
  auto* ys = static_cast<float*>(y_scratch.get(sizeof(float) * T * out));  // [T, out]
  for (int64_t h = 0; h < a.num_heads; ++h) {
    const WeightMatrix& w = a.weights[h];
    const float* x = a.x + h * a.x_head_stride;
    float* y = a.y + h * a.y_head_stride;
    const MatmulFn matmul = inner_matmul(inner, w.dtype);
    if (T == 1) {
      matmul(x, 1, w, y, inner.precision);
    } else {
      MOAT_CUDA_OK(cudaMemcpy2DAsync(xs, sizeof(float) * in, x, sizeof(float) * a.x_token_stride, sizeof(float) * in, T,
                                     cudaMemcpyDeviceToDevice));
      matmul(xs, T, w, ys, inner.precision);
      MOAT_CUDA_OK(cudaMemcpy2DAsync(y, sizeof(float) * a.y_token_stride, ys, sizeof(float) * out, sizeof(float) * out, T,
                                     cudaMemcpyDeviceToDevice));
    }
    if (a.pass > 0)
      MOAT_CUDA_OK(cudaMemcpy2DAsync(y + out, sizeof(float) * a.y_token_stride, x + in, sizeof(float) * a.x_token_stride,
                                     sizeof(float) * a.pass, T, cudaMemcpyDeviceToDevice));
  }
}

}  // namespace moat::ops::cuda
