#include "ops/registry.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>
#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace moat::ops {

bool HeadsConstraint::allows(int64_t heads) const {
  if (heads <= 0) return false;
  if (std::find(one_of.begin(), one_of.end(), heads) != one_of.end()) return true;
  return multiple_of > 0 && heads % multiple_of == 0;
}

std::optional<int64_t> HeadsConstraint::pad_target(int64_t heads) const {
  std::optional<int64_t> best;
  for (int64_t h : one_of)
    if (h >= heads && (!best || h < *best)) best = h;
  if (multiple_of > 0) {
    int64_t m = ((heads + multiple_of - 1) / multiple_of) * multiple_of;
    if (!best || m < *best) best = m;
  }
  return best;
}

std::string HeadsConstraint::describe() const {
  std::vector<std::string> parts;
  if (!one_of.empty()) parts.push_back(fmt::format("OneOf{{{}}}", fmt::join(one_of, ",")));
  if (multiple_of > 0) parts.push_back(fmt::format("MultipleOf{{{}}}", multiple_of));
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, " | "));
}

namespace {
// AMX tile data is a dynamically enabled XSAVE feature: Linux (5.16+) faults the first tile
// instruction of a process that has not asked for it. The permission is process-wide and asked
// once; a kernel without it (or a CPU without AMX) answers no and the avx512bf16 kernel runs.
bool amx_tiles_permitted() {
  static const bool permitted = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether MOAT_DISABLE_ISA (comma-separated names, registry.h) names `isa`.
bool isa_disabled(std::string_view isa) {
  static const std::vector<std::string> disabled = [] {
    std::vector<std::string> out;
    const char* env = std::getenv("MOAT_DISABLE_ISA");
    std::string_view rest = env ? env : "";
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      if (comma != 0) out.emplace_back(rest.substr(0, comma));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    return out;
  }();
  return std::find(disabled.begin(), disabled.end(), isa) != disabled.end();
}
}  // namespace

bool cpu_has_isa(std::string_view isa) {
  if (isa_disabled(isa)) return false;
  // __builtin_cpu_supports takes only string literals, hence the spelled-out names.
  // "avx512bf16" also needs VBMI (byte permutes for fp8 decode) and VNNI (4-bit decode's integer
  // dot products): Zen4 and Sapphire Rapids have all three; Cooper Lake has BF16 without VBMI and
  // takes the avx512 kernels.
  if (isa == "avx512bf16")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
  if (isa == "amx-bf16") return cpu_has_isa("avx512bf16") && amx_tiles_permitted();
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  if (isa == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return false;
}

std::vector<std::string> Constraints::check(const OpShape& shape) const {
  std::vector<std::string> reasons;
  if (!cpu_isa.empty() && !cpu_has_isa(cpu_isa))
    reasons.push_back(isa_disabled(cpu_isa) ? fmt::format("{} disabled by MOAT_DISABLE_ISA", cpu_isa)
                                            : fmt::format("this CPU lacks {}", cpu_isa));
  if (!weight_dtypes.empty() &&
      std::find(weight_dtypes.begin(), weight_dtypes.end(), shape.weight_dtype) == weight_dtypes.end()) {
    std::vector<std::string_view> names;
    for (DType d : weight_dtypes) names.push_back(dtype_name(d));
    reasons.push_back(fmt::format("weight dtype {} not in {{{}}}", dtype_name(shape.weight_dtype),
                                  fmt::join(names, ",")));
  }
  if (!kv_dtypes.empty() && std::find(kv_dtypes.begin(), kv_dtypes.end(), shape.kv_dtype) == kv_dtypes.end()) {
    std::vector<std::string_view> names;
    for (DType d : kv_dtypes) names.push_back(dtype_name(d));
    reasons.push_back(fmt::format("kv cache dtype {} not in {{{}}}", dtype_name(shape.kv_dtype), fmt::join(names, ",")));
  }
  if (heads && !heads->allows(shape.heads_per_rank))
    reasons.push_back(fmt::format("heads per rank {} not in {}", shape.heads_per_rank, heads->describe()));
  if (head_dim_multiple_of > 0 && shape.head_dim % head_dim_multiple_of != 0)
    reasons.push_back(fmt::format("head dim {} not a multiple of {}", shape.head_dim, head_dim_multiple_of));
  if (max_head_dim > 0 && shape.head_dim > max_head_dim)
    reasons.push_back(fmt::format("head dim {} > {}", shape.head_dim, max_head_dim));
  if (max_experts > 0 && shape.num_experts > max_experts)
    reasons.push_back(fmt::format("{} experts > {}", shape.num_experts, max_experts));
  if (max_top_k > 0 && shape.top_k > max_top_k)
    reasons.push_back(fmt::format("top_k {} > {}", shape.top_k, max_top_k));
  return reasons;
}

std::string Constraints::describe() const {
  std::vector<std::string> parts;
  if (!weight_dtypes.empty()) {
    std::vector<std::string_view> names;
    for (DType d : weight_dtypes) names.push_back(dtype_name(d));
    parts.push_back(fmt::format("dtype {{{}}}", fmt::join(names, ",")));
  }
  if (!kv_dtypes.empty()) {
    std::vector<std::string_view> names;
    for (DType d : kv_dtypes) names.push_back(dtype_name(d));
    parts.push_back(fmt::format("kv {{{}}}", fmt::join(names, ",")));
  }
  if (heads) parts.push_back("heads " + heads->describe());
  if (head_dim_multiple_of > 0) parts.push_back(fmt::format("head_dim % {} == 0", head_dim_multiple_of));
  if (max_head_dim > 0) parts.push_back(fmt::format("head_dim <= {}", max_head_dim));
  if (max_experts > 0) parts.push_back(fmt::format("experts <= {}", max_experts));
  if (max_top_k > 0) parts.push_back(fmt::format("top_k <= {}", max_top_k));
  if (!cpu_isa.empty()) parts.push_back(fmt::format("cpu {}", cpu_isa));
  return parts.empty() ? "any" : fmt::format("{}", fmt::join(parts, "; "));
}

std::string Resolution::describe() const {
  switch (kind) {
    case Kind::kernel: return fmt::format("Kernel {}", kernel->name);
    case Kind::pad_heads: return fmt::format("PadHeads{{{}->{}}} {}", pad_from, pad_to, kernel->name);
    case Kind::fallback: return fmt::format("Fallback {}", kernel->name);
    case Kind::unsupported: return fmt::format("Unsupported: {}", fmt::join(reasons, "; "));
  }
  return "?";
}

void register_cpu_sampling_kernels(Registry& registry);   // kernels/cpu/sampling_kernels.cpp
void register_cpu_composite_kernels(Registry& registry);  // kernels/cpu/composite_kernels.cpp

const Registry& Registry::global() {
  static const Registry registry = [] {
    Registry r;
    register_reference_kernels(r);
    register_cpu_kernels(r);
    register_cpu_sampling_kernels(r);
    register_cpu_composite_kernels(r);
#ifdef MOAT_HAVE_CUDA
    register_cuda_kernels(r);
#endif
    return r;
  }();
  return registry;
}

void Registry::add(KernelEntry entry) { entries_.push_back(std::move(entry)); }

std::vector<const KernelEntry*> Registry::kernels(OpId op, Backend backend) const {
  std::vector<const KernelEntry*> out;
  for (const auto& e : entries_)
    if (e.op == op && e.backend == backend) out.push_back(&e);
  std::stable_sort(out.begin(), out.end(),
                   [](const KernelEntry* a, const KernelEntry* b) { return a->priority > b->priority; });
  return out;
}

std::vector<const KernelEntry*> Registry::fallbacks(OpId op, Backend backend) const {
  std::vector<const KernelEntry*> out;
  for (const auto& e : entries_)
    if (e.op == op && std::find(e.fallback_for.begin(), e.fallback_for.end(), backend) != e.fallback_for.end())
      out.push_back(&e);
  std::stable_sort(out.begin(), out.end(),
                   [](const KernelEntry* a, const KernelEntry* b) { return a->priority > b->priority; });
  return out;
}

std::vector<Backend> Registry::compiled_backends() const {
  std::vector<Backend> out;
  for (Backend b : {Backend::reference, Backend::cpu, Backend::cuda})
    for (const auto& e : entries_)
      if (e.backend == b) {
        out.push_back(b);
        break;
      }
  return out;
}

Resolution Registry::resolve(OpId op, Backend backend, const OpShape& shape) const {
  Resolution res;
  const auto candidates = kernels(op, backend);
  // 1. A kernel that takes the shape as it is.
  for (const KernelEntry* k : candidates) {
    auto reasons = k->constraints.check(shape);
    if (reasons.empty()) {
      res.kind = Resolution::Kind::kernel;
      res.kernel = k;
      return res;
    }
    for (auto& r : reasons) res.reasons.push_back(fmt::format("{}: {}", k->name, r));
  }
  // 2. A kernel whose only objection is the head count, when zero-padding heads satisfies it.
  for (const KernelEntry* k : candidates) {
    if (!k->constraints.heads || k->constraints.heads->allows(shape.heads_per_rank)) continue;
    auto target = k->constraints.heads->pad_target(shape.heads_per_rank);
    if (!target) continue;
    OpShape padded = shape;
    padded.heads_per_rank = *target;
    if (k->constraints.check(padded).empty()) {
      res.kind = Resolution::Kind::pad_heads;
      res.kernel = k;
      res.pad_from = shape.heads_per_rank;
      res.pad_to = *target;
      return res;
    }
  }
  // 3. A declared fallback.
  for (const KernelEntry* k : fallbacks(op, backend)) {
    auto reasons = k->constraints.check(shape);
    if (reasons.empty()) {
      res.kind = Resolution::Kind::fallback;
      res.kernel = k;
      return res;
    }
    for (auto& r : reasons) res.reasons.push_back(fmt::format("{}: {}", k->name, r));
  }
  if (candidates.empty())
    res.reasons.insert(res.reasons.begin(),
                       fmt::format("no {} kernel for {} and no declared fallback", backend_name(backend), op_name(op)));
  res.kind = Resolution::Kind::unsupported;
  return res;
}

}  // namespace moat::ops
