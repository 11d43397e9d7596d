// CPU kernels for the sampling ops and moe_route: two copies of sampling_generic.inc, one per ISA,
// registered above the reference kernels (which stay as the declared fallback), so `moat doctor`
// shows them as Kernel. They run once per step on [rows, vocab] probabilities (vocab up to ~160k
// for Kimi / DeepSeek): the reference's copy-and-sort per row costs milliseconds there.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

// 64-byte vectors pass between inlined helpers in the avx2 copy; no ABI boundary is crossed.
#pragma GCC diagnostic ignored "-Wpsabi"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace moat::ops {
#define MOAT_CPU_NS cpu_avx512_sampling
#include "kernels/cpu/sampling_generic.inc"
#undef MOAT_CPU_NS
}  // namespace moat::ops
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace moat::ops {
#define MOAT_CPU_NS cpu_avx2_sampling
#include "kernels/cpu/sampling_generic.inc"
#undef MOAT_CPU_NS
}  // namespace moat::ops
#pragma GCC pop_options

namespace moat::ops {

void register_cpu_sampling_kernels(Registry& r) {
  struct Isa {
    const char* isa;
    int priority;  // as cpu_kernels.cpp: avx512 above avx2, both above the reference's 0
    TopKRenormFn top_k;
    TopPRenormFn top_p;
    MinPRenormFn min_p;
    SampleFromProbsFn sample;
    MoeRouteFn moe_route;
  };
#define MOAT_ISA(ns, isa, prio)                                                                     \
  Isa{isa, prio, &ns::top_k_renorm_prob, &ns::top_p_renorm_prob, &ns::min_p_renorm_prob, &ns::sample_from_probs, \
      &ns::moe_route}
  for (const Isa& k : {MOAT_ISA(cpu_avx512_sampling, "avx512", 20), MOAT_ISA(cpu_avx2_sampling, "avx2", 10)}) {
    auto add = [&](OpId op, void* fn) {
      r.add(KernelEntry{op, Backend::cpu, fmt::format("cpu.{}_{}", op_name(op), k.isa), fn,
                        Constraints{.cpu_isa = k.isa}, k.priority, {}});
    };
    add(OpId::top_k_renorm_prob, reinterpret_cast<void*>(k.top_k));
    add(OpId::top_p_renorm_prob, reinterpret_cast<void*>(k.top_p));
    add(OpId::min_p_renorm_prob, reinterpret_cast<void*>(k.min_p));
    add(OpId::sample_from_probs, reinterpret_cast<void*>(k.sample));
    add(OpId::moe_route, reinterpret_cast<void*>(k.moe_route));
  }
#undef MOAT_ISA
}

}  // namespace moat::ops
