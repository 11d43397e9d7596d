// The one CUDA error check of the .cu files: a failed runtime call is a bug or a lost device,
// so it names the call and the place, and aborts (kernels have no error path to return through).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define MOAT_CUDA_OK(expr)                                                                    \
  do {                                                                                        \
    cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: CUDA error %s: %s\n", __FILE__, __LINE__, #expr,          \
                   cudaGetErrorString(err_));                                                 \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)
