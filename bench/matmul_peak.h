// The dot-product peak a model's matmuls run at on this machine, for the benchmarks' compute
// rooflines: AMX tiles' where the cpu backend resolves bf16 matmuls to cpu.matmul_amx_bf16, else
// vdpbf16ps' where the CPU has AVX-512 BF16, else fp32 FMAs' (cpu.matmul_avx2fma decodes bf16 /
// fp8 weights to fp32). Probing vdpbf16ps unconditionally killed engine_bench with SIGILL on
// AVX2-only CPUs.
#pragma once
#include "ops/registry.h"
#include "roofline.h"

namespace moat::bench {

struct MatmulPeak {
  double gflops;
  const char* probe;  // what was measured
};

inline MatmulPeak matmul_peak() {
  const ops::Resolution r =
      ops::Registry::global().resolve(ops::OpId::matmul, ops::Backend::cpu, ops::OpShape{.weight_dtype = DType::BF16});
  if (r.usable() && r.kernel->name == "cpu.matmul_amx_bf16") return {amx_bf16_peak_gflops(), "AMX tdpbf16ps"};
  return {matmul_peak_gflops(), matmul_peak_probe()};
}

}  // namespace moat::bench
