// moat doctor: what every op on a model's path resolves to on a backend, and why.
//   moat doctor [--model DIR] [--backend cpu|cuda|reference] [--tp N] [--kv-dtype bf16|fp8|fp32]
//       prints each op the model runs (every matmul dtype, attention at its heads per rank, the
//       router, every sampling op) with Kernel / PadHeads / Fallback / Unsupported and the reasons
//       better candidates were rejected; exits 1 if anything is Unsupported.
//   moat doctor --ops-table [--out docs/ops.md]
//       regenerates the op x backend x kernel x constraints table from the registry.
#include <fmt/format.h>

#include <fstream>

#include "cli/command.h"
#include "kv/latent_cache.h"
#include "config/model_config.h"
#include "models/op_needs.h"
#include "models/registry.h"
#include "ops/dispatch.h"
#include "ops/ops_table.h"

namespace moat::cli {
namespace {

struct DoctorArgs {
  std::string model;
  std::string backend = "cpu";
  int64_t tp = 1;
  bool ep = false;
  std::string kv_dtype = "bf16";
  bool ops_table = false;
  std::string out;
};

const char* kind_label(ops::Resolution::Kind kind) {
  switch (kind) {
    case ops::Resolution::Kind::kernel: return "Kernel";
    case ops::Resolution::Kind::pad_heads: return "PadHeads";
    case ops::Resolution::Kind::fallback: return "Fallback";
    case ops::Resolution::Kind::unsupported: return "Unsupported";
  }
  return "?";
}

int run_ops_table(const DoctorArgs& a) {
  const std::string table = ops::ops_table_markdown(ops::Registry::global());
  if (a.out.empty()) {
    fmt::print("{}", table);
    return 0;
  }
  std::ofstream f(a.out, std::ios::binary);
  if (!f || !(f << table)) {
    fmt::print(stderr, "error: cannot write {}\n", a.out);
    return 1;
  }
  fmt::print("wrote {}\n", a.out);
  return 0;
}

int run_doctor(const DoctorArgs& a) {
  if (a.ops_table) return run_ops_table(a);
  auto backend = ops::parse_backend(a.backend);
  if (!backend) {
    fmt::print(stderr, "error: --backend: {}\n", backend.error().message);
    return 2;
  }
  const auto compiled = ops::Registry::global().compiled_backends();
  if (std::find(compiled.begin(), compiled.end(), *backend) == compiled.end()) {
    fmt::print(stderr, "error: --backend {}: not compiled into this binary (nvcc was not found at build time)\n",
               a.backend);
    return 2;
  }
  const std::string dir = a.model.empty() ? default_model_dir() : a.model;
  auto config = load_model_config(dir);
  if (!config) {
    fmt::print(stderr, "error: {}\n", config.error().message);
    return 1;
  }
  auto spec = weight_spec_for(*config);
  if (!spec) {
    fmt::print(stderr, "error: {}: {}\n", dir, spec.error().message);
    return 1;
  }
  auto kv = parse_kv_dtype(a.kv_dtype);
  if (!kv) {
    fmt::print(stderr, "error: {}\n", kv.error().message);
    return 2;
  }
  auto needs = model_op_needs(*config, a.tp, *kv);
  if (!needs) {
    fmt::print(stderr, "error: --tp {}: {}\n", a.tp, needs.error().message);
    return 1;
  }
  fmt::print("model {} ({}), backend {}, tp {}: {} heads per rank, attention head dim {}, {} experts (top {})\n", dir,
             config->architecture, a.backend, a.tp, needs->heads_per_rank, needs->attention_head_dim,
             needs->num_experts, needs->top_k);
  int64_t params = 0, dense = 0, moe = 0, kda = 0;
  for (const TensorSpec& t : spec->tensors) params += t.numel();
  for (const LayerSpec& l : spec->layers) {
    ++(l.ffn == FfnKind::moe ? moe : dense);
    kda += l.attention == AttentionKind::kda;
  }
  const int64_t mla = static_cast<int64_t>(spec->layers.size()) - kda;
  const std::string kinds = kda == 0 ? fmt::format("{} MLA layers", mla)
                                     : fmt::format("{} layers ({} KDA, {} MLA)", spec->layers.size(), kda, mla);
  fmt::print("weights: {} tensors, {:.1f}M parameters; {}: {} dense MLP, {} MoE{}\n", spec->tensors.size(),
             static_cast<double>(params) / 1e6, kinds, dense, moe,
             config->num_nextn_predict_layers > 0
                 ? fmt::format(" ({} MTP layers in the checkpoint: the proposer of --speculative mtp)", config->num_nextn_predict_layers)
                 : "");
  if (kda > 0)
    fmt::print("KDA: {} heads per rank, head dim {}; recurrent state {} bytes per request per rank (split by head), "
               "beside {} bytes of MLA latent per token\n",
               needs->kda_heads_per_rank, needs->kda_head_dim, config->state_bytes_per_request() / a.tp,
               mla * config->kv_cache_dim() * static_cast<int64_t>(dtype_size(*kv)));
  bool tp_refused = false;
  if (a.tp > 1) {
    const auto problems = tp_split_problems(*spec, static_cast<int>(a.tp), a.ep);
    const std::string experts = config->n_routed_experts == 0 ? ""
                                : a.ep ? fmt::format("; routed experts by expert (--ep): {}-{} per rank",
                                                     config->n_routed_experts / a.tp,
                                                     (config->n_routed_experts + a.tp - 1) / a.tp)
                                       : fmt::format("; each routed expert's width split: {} per rank",
                                                     config->moe_intermediate_size / a.tp);
    if (problems.empty()) {
      fmt::print("tensor parallel: every tensor splits over {} ranks{}\n", a.tp, experts);
    } else {
      for (const std::string& p : problems) fmt::print("tensor parallel: cannot split {}\n", p);
    }
    tp_refused = !problems.empty();
  }
  fmt::print("backend {}: {}\n\n", a.backend, ops::backend_hardware_status(*backend));
  int unsupported = 0;
  for (const ops::ResolvedOp& r : ops::OpTable::plan(*backend, *needs)) {
    const auto& res = r.resolution;
    std::string what = res.kernel ? res.kernel->name : "";
    if (res.kind == ops::Resolution::Kind::pad_heads)
      what = fmt::format("{{{}->{}}} {} (zero-pad heads, run, slice back)", res.pad_from, res.pad_to, what);
    fmt::print("  {:<44} {:<11} {}\n", r.use, kind_label(res.kind), what);
    auto reasons = res.reasons;
    if (res.kind == ops::Resolution::Kind::fallback && ops::Registry::global().kernels(r.op, *backend).empty())
      reasons.insert(reasons.begin(), fmt::format("no {} kernel for {}; the declared fallback runs", a.backend,
                                                  ops::op_name(r.op)));
    for (const std::string& why : reasons) fmt::print("  {:<44} {:<11}   why not: {}\n", "", "", why);
    if (!res.usable()) ++unsupported;
  }
  if (unsupported > 0) {
    fmt::print("\n{} op(s) Unsupported on {}: the engine would refuse to load this model\n", unsupported, a.backend);
    return 1;
  }
  fmt::print("\nevery op resolves on {}\n", a.backend);
  if (tp_refused) {
    fmt::print("but the weights do not split over {} ranks (above): the engine would refuse to load at --tp {}{}\n", a.tp,
               a.tp, a.ep ? "" : " (--ep may)");
    return 1;
  }
  // Speculative verification and guess drawing (src/spec) add no op of their own: they run the
  // sampling ops above on the target's and the proposer's rows.
  fmt::print("speculative decoding (draft, ngram, mtp) runs on the sampling ops above: softmax, top_k/top_p/min_p "
             "renorm, sample_from_probs, argmax\n");
  return 0;
}

void setup(CLI::App& sub, int& exit_code) {
  auto args = std::make_shared<DoctorArgs>();
  sub.add_option("--model", args->model, "Model directory with config.json (default: the shipped model)");
  sub.add_option("--backend", args->backend, "reference | cpu | cuda")->capture_default_str();
  sub.add_option("--tp", args->tp, "Tensor-parallel degree (heads per rank = heads / tp)")->capture_default_str();
  sub.add_flag("--ep", args->ep, "With --tp: routed experts split by expert across the ranks");
  sub.add_option("--kv-dtype", args->kv_dtype, "latent KV cache element type: bf16, fp8, fp32")->capture_default_str();
  sub.add_flag("--ops-table", args->ops_table, "Print the op x backend x kernel table (docs/ops.md)");
  sub.add_option("--out", args->out, "With --ops-table: write the table to this file");
  sub.callback([args, &exit_code] { exit_code = run_doctor(*args); });
}

CommandRegistrar registrar("doctor", "Show how every op of a model resolves on a backend, and why", setup);

}  // namespace
}  // namespace moat::cli
