// The dot-product peak a model's matmuls run at on this machine, for the benchmarks' compute
// rooflines: that of the kernel the cpu backend resolves bf16 matmuls to (MOAT_DISABLE_ISA
// included): AMX tiles' for cpu.matmul_amx_bf16, vdpbf16ps' for cpu.matmul_avx512bf16, 512-bit
// FMAs' for cpu.matmul_avx512fma, 256-bit FMAs' for cpu.matmul_avx2fma (the last two decode bf16 /
// fp8 weights to fp32). Probing vdpbf16ps unconditionally killed engine_bench with SIGILL on
// AVX2-only CPUs.
#pragma once
#include <string_view>

#include "ops/registry.h"
#include "roofline.h"

namespace moat::bench {

struct MatmulPeak {
  double gflops;
  const char* probe;  // what was measured
};

inline MatmulPeak kernel_peak(std::string_view kernel) {
  if (kernel == "cpu.matmul_amx_bf16") return {amx_bf16_peak_gflops(), "AMX tdpbf16ps"};
  if (kernel == "cpu.matmul_avx512bf16") return {bf16_peak_gflops(), "vdpbf16ps x24 chains"};
  if (kernel == "cpu.matmul_avx2fma") return {fp32_ymm_peak_gflops(), "vfmadd231ps ymm x12 chains"};
  return {fp32_peak_gflops(), fp32_peak_probe()};
}

inline MatmulPeak matmul_peak() {
  const ops::Resolution r =
      ops::Registry::global().resolve(ops::OpId::matmul, ops::Backend::cpu, ops::OpShape{.weight_dtype = DType::BF16});
  return kernel_peak(r.usable() ? r.kernel->name : "");
}

}  // namespace moat::bench
