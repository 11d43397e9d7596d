// The cuda matmul for 4-bit weights (MXFP4, INT4_G32: base/weight.h), decoded in registers: a
// simple kernel, correct before fast. One warp per output row and up to kTokTile tokens per
// block column; lane l takes the row's groups l, l + 32, ...: it loads the group's 16 code bytes,
// looks each nibble up in a 16-entry shared-memory table, multiplies by the group scale and
// accumulates against every token of the tile in fp32; a warp reduction then writes y. The
// activations stay fp32 (no bf16 rounding): exact up to fp32 summation order. No tensor cores:
// prefill-sized calls re-decode the weights once per token tile, which is where a tuned kernel
// (dequantize to bf16 tiles + MMA) would go.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/cuda_backend.h"

namespace moat::ops::cuda {
namespace {

constexpr int kTokTile = 8;
constexpr int kWarpsPerBlock = 8;

__device__ float q4_scale(const void* scales, bool bf16, int64_t i) {
  if (bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(scales)[i]);
  const uint32_t s = static_cast<const uint8_t*>(scales)[i];  // e8m0; 255 (NaN) is refused at load
  return __uint_as_float(s == 0 ? 0x00400000u : s << 23);
}

// kAligned: the packed rows start 16-byte aligned (one 128-bit load per group), else byte loads.
template <bool kAligned>
__global__ void matmul_q4_kernel(const float* __restrict__ x, int64_t T, const uint8_t* __restrict__ packed,
                                 const void* __restrict__ scales, bool bf16_scales, const float* codes, int64_t N,
                                 int64_t K, float* __restrict__ y) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = codes[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTokTile;
  if (n >= N) return;
  const int nt = static_cast<int>(T - t0 < kTokTile ? T - t0 : kTokTile);
  const int64_t groups = K / 32;
  const uint8_t* row = packed + n * (K / 2);
  float acc[kTokTile];
#pragma unroll
  for (int t = 0; t < kTokTile; ++t) acc[t] = 0.0f;
  for (int64_t g = lane; g < groups; g += 32) {
    uint8_t b[16];
    if constexpr (kAligned) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * g);
      memcpy(b, &v, 16);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) b[j] = row[16 * g + j];
    }
    const float s = q4_scale(scales, bf16_scales, n * groups + g);
    float w[32];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      w[2 * j] = table[b[j] & 15] * s;
      w[2 * j + 1] = table[b[j] >> 4] * s;
    }
#pragma unroll
    for (int t = 0; t < kTokTile; ++t) {
      if (t >= nt) break;
      const float* xt = x + (t0 + t) * K + 32 * g;
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < 32; ++j) a = fmaf(w[j], xt[j], a);
      acc[t] += a;
    }
  }
#pragma unroll
  for (int t = 0; t < kTokTile; ++t) {
    float v = acc[t];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0 && t < nt) y[(t0 + t) * N + n] = v;
  }
}

// The code tables in device memory (e2m1 for MXFP4, nibble - 8 for INT4), copied once.
const float* device_codes(DType dtype) {
  static float* tables = [] {
    float host[32];
    for (int i = 0; i < 16; ++i) {
      host[i] = int4_code_table(DType::MXFP4)[i];
      host[16 + i] = int4_code_table(DType::INT4_G32)[i];
    }
    float* d = nullptr;
    if (cudaMalloc(&d, sizeof host) != cudaSuccess || cudaMemcpy(d, host, sizeof host, cudaMemcpyHostToDevice) != cudaSuccess) {
      std::fprintf(stderr, "matmul_q4: cannot copy the code tables to the device\n");
      std::abort();
    }
    return d;
  }();
  return tables + (dtype == DType::MXFP4 ? 0 : 16);
}

}  // namespace

void matmul_q4(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision&) {
  if (T == 0 || w.out_features == 0) return;
  if (!w.is_4bit() || w.in_features % 32 != 0) {
    std::fprintf(stderr, "cuda.matmul_q4: weight dtype %d [%lld, %lld] is not a 4-bit matrix with K %% 32 == 0\n",
                 static_cast<int>(w.dtype), static_cast<long long>(w.out_features),
                 static_cast<long long>(w.in_features));
    std::abort();
  }
  const dim3 grid(static_cast<unsigned>((w.out_features + kWarpsPerBlock - 1) / kWarpsPerBlock),
                  static_cast<unsigned>((T + kTokTile - 1) / kTokTile));
  const auto* packed = static_cast<const uint8_t*>(w.data);
  const bool bf16 = w.group_scale_kind == GroupScaleKind::bf16;
  const float* codes = device_codes(w.dtype);
  if (reinterpret_cast<uintptr_t>(packed) % 16 == 0)  // rows are K/2 bytes, a multiple of 16
    matmul_q4_kernel<true><<<grid, 32 * kWarpsPerBlock>>>(x, T, packed, w.group_scales, bf16, codes, w.out_features,
                                                          w.in_features, y);
  else
    matmul_q4_kernel<false><<<grid, 32 * kWarpsPerBlock>>>(x, T, packed, w.group_scales, bf16, codes, w.out_features,
                                                           w.in_features, y);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s:%d: CUDA error launching matmul_q4: %s\n", __FILE__, __LINE__, cudaGetErrorString(err));
    std::abort();
  }
}

}  // namespace moat::ops::cuda
