// CPU backend: SIMD kernels with runtime CPU-feature dispatch. Each kernel is registered with the
// instruction set it needs (Constraints::cpu_isa), so resolution picks the best one the running
// CPU has and `moat doctor` says why the others were skipped. The sampling ops and moe_route
// have their kernels in sampling_kernels.cpp.
#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "ops/registry.h"

// The vector helpers pass 32- and 64-byte vectors between inlined functions; no ABI boundary is crossed.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's intrinsics headers start some shuffles from an _mm*_undefined value (reduce16's
// _mm512_shuffle_f32x4): false positives.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Two copies of cpu_generic.inc: one per ISA, each compiled under its own target pragma.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#pragma GCC optimize("fp-contract=fast")
#include "kernels/cpu/avx512_helpers.h"  // reduce16 for the avx512 copy's MLA score pass
namespace moat::ops {
#define MOAT_CPU_NS cpu_avx512
#define MOAT_CPU_LANES 16
#include "kernels/cpu/cpu_generic.inc"
#include "kernels/cpu/k3_generic.inc"  // Kimi K3 ops: use cpu_generic.inc's vector helpers
#undef MOAT_CPU_NS
#undef MOAT_CPU_LANES
}  // namespace moat::ops
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=fast")
namespace moat::ops {
#define MOAT_CPU_NS cpu_avx2
#define MOAT_CPU_LANES 8
#include "kernels/cpu/cpu_generic.inc"
#include "kernels/cpu/k3_generic.inc"  // Kimi K3 ops: use cpu_generic.inc's vector helpers
#undef MOAT_CPU_NS
#undef MOAT_CPU_LANES
}  // namespace moat::ops
#pragma GCC pop_options

namespace moat::ops {

void register_cpu_kda_kernels(Registry& registry);  // kda_cpu.cpp

void register_cpu_kernels(Registry& r) {
  auto add = [&](OpId op, std::string name, void* fn, Constraints c, int priority, void* group_fn = nullptr) {
    r.add(KernelEntry{op, Backend::cpu, std::move(name), fn, std::move(c), priority, {}, group_fn});
  };
  // The production MLA decode kernels accept these heads per rank; the cpu kernel declares the
  // same (its inner loop takes heads 4 at a time), so a 12-head rank resolves to PadHeads{12->16}
  // here exactly as it would on a GPU.
  const HeadsConstraint mla_heads{.one_of = {4, 8}, .multiple_of = 16};
  const std::vector<DType> kv_dtypes = {DType::F32, DType::BF16, DType::F8_E4M3};

  struct Isa {
    const char* isa;
    const char* tag;
    int priority;
    EmbeddingFn embedding;
    MatmulFn matmul;
    RmsNormFn rms_norm;
    RopeFn rope;
    SiluMulFn silu_mul;
    AddScaledFn add_scaled;
    SoftmaxFn softmax;
    ArgmaxFn argmax;
    StoreLatentFn store_latent;
    MlaAttentionFn mla;
  };
#define MOAT_ISA(ns, isa, prio)                                                                       \
  Isa{isa, #ns, prio, &ns::embedding, &ns::matmul, &ns::rms_norm, &ns::rope, &ns::silu_mul, &ns::add_scaled, \
      &ns::softmax, &ns::argmax, &ns::store_latent, &ns::mla_attention}
  for (const Isa& k : {MOAT_ISA(cpu_avx512, "avx512", 20), MOAT_ISA(cpu_avx2, "avx2", 10)}) {
    auto name = [&](const char* op) { return fmt::format("cpu.{}_{}", op, k.isa); };
    auto c = [&](Constraints base) {
      base.cpu_isa = k.isa;
      return base;
    };
    auto fn = [](auto f) { return reinterpret_cast<void*>(f); };
    add(OpId::embedding, name("embedding"), fn(k.embedding),
        c({.weight_dtypes = {DType::BF16, DType::F16, DType::F32}}), k.priority);
    // fp32 FMAs on dequantized rows: the only cpu kernel for f32 weights, and the bf16/fp8 path
    // on CPUs without avx512bf16.
    add(OpId::matmul, name("matmul_f32fma"), fn(k.matmul),
        c({.weight_dtypes = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32}}),
        k.priority);
    add(OpId::rms_norm, name("rms_norm"), fn(k.rms_norm), c({}), k.priority);
    add(OpId::rope, name("rope"), fn(k.rope), c({}), k.priority);
    add(OpId::silu_mul, name("silu_mul"), fn(k.silu_mul), c({}), k.priority);
    add(OpId::add_scaled, name("add_scaled"), fn(k.add_scaled), c({}), k.priority);
    add(OpId::softmax, name("softmax"), fn(k.softmax), c({}), k.priority);
    add(OpId::argmax, name("argmax"), fn(k.argmax), c({}), k.priority);
    // Both read and write the paged cache in every dtype the engine offers (--kv-dtype).
    add(OpId::store_latent, name("store_latent"), fn(k.store_latent), c({.kv_dtypes = kv_dtypes}), k.priority);
    add(OpId::mla_attention, name("mla_attention"), fn(k.mla), c({.heads = mla_heads, .kv_dtypes = kv_dtypes}),
        k.priority);
  }
#undef MOAT_ISA
  // Machines with AVX2 but no AVX-512 BF16 (Zen 2 / 3, Intel client cores, and the AVX-512F-only
  // servers: Skylake-SP, Cascade Lake, Ice Lake, which run the 512-bit twin below): weights decoded
  // in registers for decode, a packed register-blocked GEMM for prefill. Above the generic avx512
  // copy, which decodes rows to memory:
  // with AVX-512 BF16 taken away (MOAT_DISABLE_ISA=avx512bf16, Zen 5, 1 thread, 2048 x 2048,
  // alternating calls) that one ran bf16 at 0.11x this kernel's speed at T = 1 (3.9 against 33.9
  // GFLOPS), 0.24x at T = 8, 0.31x at T = 64 and 512; fp8 0.09x / 0.28x / 0.31x / 0.27x. Until
  // 2026-12-04 it sat below that copy (15 against 20), so those servers decoded at ~10% of their
  // bandwidth (kernel_bench --decode-only: 3.5 GB/s of bf16 weights against 37).
  add(OpId::matmul, "cpu.matmul_avx2fma", reinterpret_cast<void*>(&cpu_avx2_fma::matmul),
      Constraints{.weight_dtypes = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32},
                  .cpu_isa = "avx2"},
      25,
      reinterpret_cast<void*>(&cpu_avx2_fma::matmul_group));
  // AVX-512F without BF16 dot products (Skylake-SP .. Ice Lake servers), and fp32 weights anywhere
  // AVX-512 is: the same kernel with its prefill-sized calls on 512-bit FMAs (Zen 5 with BF16 taken
  // away: 0.53x the time of the ymm GEMM at T = 512, 512-token prefill 1.6-1.8x).
  add(OpId::matmul, "cpu.matmul_avx512fma", reinterpret_cast<void*>(&cpu_avx2_fma::matmul_wide),
      Constraints{.weight_dtypes = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32},
                  .cpu_isa = "avx512"},
      26,
      reinterpret_cast<void*>(&cpu_avx2_fma::matmul_group_wide));
  // bf16 dot products: twice the fp32 FMA rate, and activations rounded to bf16 once per call.
  add(OpId::matmul, "cpu.matmul_avx512bf16", reinterpret_cast<void*>(&cpu_avx512bf16::matmul),
      Constraints{.weight_dtypes = {DType::BF16, DType::F16, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32},
                  .cpu_isa = "avx512bf16"},
      30, reinterpret_cast<void*>(&cpu_avx512bf16::matmul_group));
  // AMX tiles for the calls that run on packed panels (T > 8 bf16, > 64 fp8, > 16 4-bit): the
  // dot products of prefill at tile rate. Decode-sized calls are the avx512bf16 kernel's own.
  add(OpId::matmul, "cpu.matmul_amx_bf16", reinterpret_cast<void*>(&cpu_avx512bf16::matmul_amx),
      Constraints{.weight_dtypes = {DType::BF16, DType::F16, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32},
                  .cpu_isa = "amx-bf16"},
      40, reinterpret_cast<void*>(&cpu_avx512bf16::matmul_group_amx));
  // Decode on bf16 dot products over the bf16 cache in place (default precision; --exact calls go
  // on to the avx512 kernel inside): twice the multiply-adds per instruction of fp32 FMAs.
  add(OpId::mla_attention, "cpu.mla_attention_avx512bf16", reinterpret_cast<void*>(&cpu_avx512bf16::mla_attention_bf16),
      Constraints{.heads = mla_heads, .kv_dtypes = {DType::BF16}, .cpu_isa = "avx512bf16"}, 30);
  // Prompt-sized runs of query tokens on tiles (flash attention; 5-7x the avx512 kernel's rate on
  // a 1024-token prompt, kernel_bench); decode tokens and --exact calls go on to the avx512 kernel
  // inside.
  add(OpId::mla_attention, "cpu.mla_attention_amx", reinterpret_cast<void*>(&cpu_avx512bf16::mla_attention_amx),
      Constraints{.heads = mla_heads, .kv_dtypes = kv_dtypes, .cpu_isa = "amx-bf16"}, 40);
  register_cpu_kda_kernels(r);

  // ---- Kimi K3 (k3_generic.inc): the same ISA / priority pattern as silu_mul ----
  struct K3Isa {
    const char* isa;
    int priority;
    SituMulFn situ_mul;
    SigmoidMulFn sigmoid_mul;
    AttnResMixFn attn_res_mix;
  };
  for (const K3Isa& k : {K3Isa{"avx512", 20, &cpu_avx512::situ_mul, &cpu_avx512::sigmoid_mul, &cpu_avx512::attn_res_mix},
                         K3Isa{"avx2", 10, &cpu_avx2::situ_mul, &cpu_avx2::sigmoid_mul, &cpu_avx2::attn_res_mix}}) {
    auto name = [&](const char* op) { return fmt::format("cpu.{}_{}", op, k.isa); };
    const Constraints c{.cpu_isa = k.isa};
    add(OpId::situ_mul, name("situ_mul"), reinterpret_cast<void*>(k.situ_mul), c, k.priority);
    add(OpId::sigmoid_mul, name("sigmoid_mul"), reinterpret_cast<void*>(k.sigmoid_mul), c, k.priority);
    add(OpId::attn_res_mix, name("attn_res_mix"), reinterpret_cast<void*>(k.attn_res_mix), c, k.priority);
  }
}

}  // namespace moat::ops
