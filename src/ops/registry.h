// Kernel registry and load-time dispatch (DESIGN.md, "The kernel registry").
//
// Each kernel registers for one (op, backend) with the constraints it supports. Checking a
// constraint returns reasons, never a bare bool, so `moat doctor` can say exactly why a kernel
// was not chosen. resolve() turns (op, backend, shape facts) into one of:
//   Kernel      the best kernel of that backend accepts the shape as is;
//   PadHeads    a kernel accepts it once heads are zero-padded (12 -> 16), run, sliced back;
//   Fallback    no kernel of the backend fits; a kernel declared as its fallback does;
//   Unsupported nothing fits: the reasons of every candidate, and the engine refuses to start.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "ops/op_list.h"

namespace moat::ops {

// The facts about one use of an op that constraints are checked against.
struct OpShape {
  int64_t heads_per_rank = 0;  // attention ops
  int64_t head_dim = 0;        // attention: kv_lora + rope (576 for DeepSeek-V3)
  DType weight_dtype = DType::F32;  // matmul, embedding
  int64_t num_experts = 0;     // moe_route
  int64_t top_k = 0;           // moe_route
  DType kv_dtype = DType::BF16;  // store_latent, mla_attention: the paged cache's element type
};

// Heads per rank a kernel accepts: any of one_of, or any multiple of multiple_of.
// The production MLA kernels this models accept OneOf{4,8} | MultipleOf{16}.
struct HeadsConstraint {
  std::vector<int64_t> one_of;
  int64_t multiple_of = 0;

  bool allows(int64_t heads) const;
  // The smallest allowed head count >= heads (what PadHeads pads to).
  std::optional<int64_t> pad_target(int64_t heads) const;
  std::string describe() const;  // "OneOf{4,8} | MultipleOf{16}"
};

struct Constraints {
  std::vector<DType> weight_dtypes;      // empty: any
  std::optional<HeadsConstraint> heads;  // unset: any
  int64_t head_dim_multiple_of = 0;      // 0: any
  int64_t max_head_dim = 0;              // 0: any
  int64_t max_experts = 0;               // 0: any
  int64_t max_top_k = 0;                 // 0: any
  std::vector<DType> kv_dtypes;          // latent cache element types; empty: any
  // CPU instruction set the kernel needs ("amx-bf16", "avx512bf16", "avx512", "avx2"); checked against the
  // running CPU, so one binary picks the best kernel on any x86-64 machine. Empty: none.
  std::string cpu_isa;

  // Reasons the shape is not accepted; empty when it is.
  std::vector<std::string> check(const OpShape& shape) const;
  std::string describe() const;
};

// Whether the running CPU has an instruction set named in Constraints::cpu_isa and may use it:
// "amx-bf16" (which needs avx512bf16 too, and Linux's permission for the tile state),
// "avx512bf16", "avx512", "avx2". MOAT_DISABLE_ISA (comma-separated names, as oneDNN's
// ONEDNN_MAX_CPU_ISA) takes any of them away: to compare kernels on one machine, or to step
// around a kernel suspected of a fault; disabling avx512bf16 takes amx-bf16 with it.
bool cpu_has_isa(std::string_view isa);

struct KernelEntry {
  OpId op;
  Backend backend;
  std::string name;    // "cpu.matmul_bf16_avx512"
  void* fn;            // the op's *Fn type from kernel_types.h
  Constraints constraints;
  int priority = 0;    // higher wins among kernels that accept a shape
  // Backends for which this kernel is a declared fallback (reference kernels run on host
  // memory, so they back up the cpu backend).
  std::vector<Backend> fallback_for;
  // matmul kernels only, optional: the same kernel over weights sharing x (MatmulGroupFn).
  void* group_fn = nullptr;
};

struct Resolution {
  enum class Kind { kernel, pad_heads, fallback, unsupported };
  Kind kind = Kind::unsupported;
  const KernelEntry* kernel = nullptr;
  int64_t pad_from = 0;
  int64_t pad_to = 0;
  std::vector<std::string> reasons;  // why better candidates were rejected, or why unsupported

  bool usable() const { return kind != Kind::unsupported; }
  std::string describe() const;  // "PadHeads{12->16} cpu.mla_attention_avx512"
};

class Registry {
 public:
  // The process-wide registry, with every compiled backend's kernels registered.
  static const Registry& global();

  void add(KernelEntry entry);
  // Kernels registered for (op, backend), highest priority first.
  std::vector<const KernelEntry*> kernels(OpId op, Backend backend) const;
  // Kernels of other backends declared as fallbacks for `backend`.
  std::vector<const KernelEntry*> fallbacks(OpId op, Backend backend) const;
  const std::vector<KernelEntry>& all() const { return entries_; }
  // Backends compiled into this binary (reference and cpu always; cuda with nvcc).
  std::vector<Backend> compiled_backends() const;

  Resolution resolve(OpId op, Backend backend, const OpShape& shape) const;

 private:
  std::vector<KernelEntry> entries_;
};

// Registration entry points, one per kernel folder; Registry::global() calls each once.
void register_reference_kernels(Registry& registry);
void register_cpu_kernels(Registry& registry);
#ifdef MOAT_HAVE_CUDA
void register_cuda_kernels(Registry& registry);
#endif

}  // namespace moat::ops
