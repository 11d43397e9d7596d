#include "ops/dispatch.h"

#include <limits>

#include "kernels/cpu/cpu_kernels.h"

#include <cstring>
#include <vector>

#ifdef MOAT_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moat::ops {

Result<Backend> parse_backend(std::string_view name) {
  for (int i = 0; i < static_cast<int>(kBackendNames.size()); ++i)
    if (kBackendNames[i] == name) return static_cast<Backend>(i);
  return make_error("unknown backend '{}': expected one of reference, cpu, cuda", name);
}

std::vector<ResolvedOp> OpTable::plan(Backend backend, const ModelOpNeeds& needs) {
  const Registry& registry = Registry::global();
  std::vector<ResolvedOp> out;
  auto add = [&](OpId op, std::string use, OpShape shape) {
    out.push_back({op, std::move(use), shape, registry.resolve(op, backend, shape)});
  };
  add(OpId::embedding, fmt::format("embedding[{}]", dtype_name(needs.embedding_dtype)),
      OpShape{.weight_dtype = needs.embedding_dtype});
  for (DType d : needs.matmul_dtypes)
    add(OpId::matmul, fmt::format("matmul[{}]", dtype_name(d)), OpShape{.weight_dtype = d});
  add(OpId::rms_norm, "rms_norm", {});
  add(OpId::rope, "rope", {});
  add(OpId::silu_mul, "silu_mul", {});
  add(OpId::add_scaled, "add_scaled", {});
  add(OpId::store_latent, fmt::format("store_latent[kv={}]", dtype_name(needs.kv_dtype)),
      OpShape{.head_dim = needs.attention_head_dim, .kv_dtype = needs.kv_dtype});
  add(OpId::mla_attention, fmt::format("mla_attention[heads/rank={}, D={}, kv={}]", needs.heads_per_rank,
                                       needs.attention_head_dim, dtype_name(needs.kv_dtype)),
      OpShape{.heads_per_rank = needs.heads_per_rank, .head_dim = needs.attention_head_dim,
              .kv_dtype = needs.kv_dtype});
  for (DType d : needs.matmul_dtypes)
    add(OpId::head_matmul, fmt::format("head_matmul[{}]", dtype_name(d)), OpShape{.weight_dtype = d});
  if (needs.num_experts > 0) {
    add(OpId::moe_route, fmt::format("moe_route[E={}, k={}]", needs.num_experts, needs.top_k),
        OpShape{.num_experts = needs.num_experts, .top_k = needs.top_k});
    add(OpId::moe_experts,
        fmt::format("moe_experts[{}, E={}, k={}]", dtype_name(needs.expert_dtype), needs.num_experts, needs.top_k),
        OpShape{.weight_dtype = needs.expert_dtype, .num_experts = needs.num_experts, .top_k = needs.top_k});
  }
  if (needs.kda_heads_per_rank > 0) {
    const OpShape kda{.heads_per_rank = needs.kda_heads_per_rank, .head_dim = needs.kda_head_dim};
    for (OpId op : {OpId::short_conv, OpId::kda_gate, OpId::kda_recurrent, OpId::kda_chunked, OpId::gated_rms_norm})
      add(op, fmt::format("{}[heads/rank={}, D={}]", op_name(op), needs.kda_heads_per_rank, needs.kda_head_dim), kda);
  }
  for (OpId op : {OpId::softmax, OpId::top_k_renorm_prob, OpId::top_p_renorm_prob,
                  OpId::min_p_renorm_prob, OpId::sample_from_probs, OpId::argmax})
    add(op, std::string(op_name(op)), {});
  // Kimi K3's SiTU MLPs, MLA output gate and attention residuals
  if (needs.k3_ops)
    for (OpId op : {OpId::situ_mul, OpId::sigmoid_mul, OpId::attn_res_mix}) add(op, std::string(op_name(op)), {});
  return out;
}

Result<OpTable> OpTable::resolve(Backend backend, const ModelOpNeeds& needs) {
  OpTable table;
  table.backend_ = backend;
  table.resolved_ = plan(backend, needs);
  std::vector<std::string> unsupported;
  for (const ResolvedOp& r : table.resolved_) {
    if (!r.resolution.usable()) {
      unsupported.push_back(fmt::format("{} on {}: {}", r.use, backend_name(backend),
                                        fmt::join(r.resolution.reasons, "; ")));
      continue;
    }
    void* fn = r.resolution.kernel->fn;
    switch (r.op) {
      case OpId::embedding: table.embedding_ = reinterpret_cast<EmbeddingFn>(fn); break;
      case OpId::matmul:
        table.matmul_[static_cast<int>(r.shape.weight_dtype)] = reinterpret_cast<MatmulFn>(fn);
        table.matmul_group_[static_cast<int>(r.shape.weight_dtype)] =
            reinterpret_cast<MatmulGroupFn>(r.resolution.kernel->group_fn);
        break;
      case OpId::rms_norm: table.rms_norm_ = reinterpret_cast<RmsNormFn>(fn); break;
      case OpId::rope: table.rope_ = reinterpret_cast<RopeFn>(fn); break;
      case OpId::silu_mul: table.silu_mul_ = reinterpret_cast<SiluMulFn>(fn); break;
      case OpId::add_scaled: table.add_scaled_ = reinterpret_cast<AddScaledFn>(fn); break;
      case OpId::store_latent: table.store_latent_ = reinterpret_cast<StoreLatentFn>(fn); break;
      case OpId::mla_attention:
        table.mla_attention_ = reinterpret_cast<MlaAttentionFn>(fn);
        if (r.resolution.kind == Resolution::Kind::pad_heads) table.mla_pad_to_ = r.resolution.pad_to;
        break;
      case OpId::moe_route: table.moe_route_ = reinterpret_cast<MoeRouteFn>(fn); break;
      case OpId::moe_experts: table.moe_experts_ = reinterpret_cast<MoeExpertsFn>(fn); break;
      case OpId::head_matmul:
        table.head_matmul_[static_cast<int>(r.shape.weight_dtype)] = reinterpret_cast<HeadMatmulFn>(fn);
        break;
      case OpId::short_conv: table.short_conv_ = reinterpret_cast<ShortConvFn>(fn); break;
      case OpId::kda_gate: table.kda_gate_ = reinterpret_cast<KdaGateFn>(fn); break;
      case OpId::kda_recurrent: table.kda_recurrent_ = reinterpret_cast<KdaFn>(fn); break;
      case OpId::kda_chunked: table.kda_chunked_ = reinterpret_cast<KdaFn>(fn); break;
      case OpId::gated_rms_norm: table.gated_rms_norm_ = reinterpret_cast<GatedRmsNormFn>(fn); break;
      case OpId::softmax: table.softmax_ = reinterpret_cast<SoftmaxFn>(fn); break;
      case OpId::top_k_renorm_prob: table.top_k_ = reinterpret_cast<TopKRenormFn>(fn); break;
      case OpId::top_p_renorm_prob: table.top_p_ = reinterpret_cast<TopPRenormFn>(fn); break;
      case OpId::min_p_renorm_prob: table.min_p_ = reinterpret_cast<MinPRenormFn>(fn); break;
      case OpId::sample_from_probs: table.sample_ = reinterpret_cast<SampleFromProbsFn>(fn); break;
      case OpId::argmax: table.argmax_ = reinterpret_cast<ArgmaxFn>(fn); break;
      // Kimi K3
      case OpId::situ_mul: table.situ_mul_ = reinterpret_cast<SituMulFn>(fn); break;
      case OpId::sigmoid_mul: table.sigmoid_mul_ = reinterpret_cast<SigmoidMulFn>(fn); break;
      case OpId::attn_res_mix: table.attn_res_mix_ = reinterpret_cast<AttnResMixFn>(fn); break;
    }
  }
  if (!unsupported.empty())
    return make_error("cannot run this model on the {} backend:\n  {}", backend_name(backend),
                      fmt::join(unsupported, "\n  "));
  return table;
}

double routed_expert_bytes(const MoeExpertsArgs& args) {
  std::vector<bool> seen(static_cast<size_t>(args.num_experts), false);
  double bytes = 0;
  for (int64_t i = 0; i < args.num_tokens * args.top_k; ++i) {
    const int32_t e = args.topk_ids[i];
    if (e < 0 || e >= args.num_experts || seen[static_cast<size_t>(e)]) continue;
    seen[static_cast<size_t>(e)] = true;
    const MlpWeights& w = args.experts[e];
    bytes += static_cast<double>(w.gate_proj.bytes() + w.up_proj.bytes() + w.down_proj.bytes());
  }
  return bytes;
}

void OpTable::matmul_group(const float* x, int64_t T, const MatmulOut* outs, int64_t count) const {
  MOAT_CHECK(count >= 1 && count <= kMaxMatmulGroup, "matmul_group of {} weights (1..{})", count, kMaxMatmulGroup);
  const WeightMatrix& first = *outs[0].w;
  bool one_call = matmul_group_[static_cast<int>(first.dtype)] != nullptr;
  std::array<const WeightMatrix*, kMaxMatmulGroup> ws{};
  std::array<float*, kMaxMatmulGroup> ys{};
  double bytes = 0;
  for (int64_t i = 0; i < count; ++i) {
    const WeightMatrix* w = outs[i].w;
    MOAT_CHECK(w->in_features == first.in_features, "matmul_group: weights of {} and {} inputs share no x",
               first.in_features, w->in_features);
    one_call = one_call && w->dtype == first.dtype;
    ws[i] = w;
    ys[i] = outs[i].y;
    bytes += static_cast<double>(w->bytes());
  }
  if (!one_call) {
    for (int64_t j = 0; j < count; ++j) matmul(x, T, *ws[j], ys[j]);
    return;
  }
  OpProfileScope scope(profile_, OpProfile::matmul, profile_ ? bytes : 0);
  matmul_group_[static_cast<int>(first.dtype)](x, T, ws.data(), ys.data(), count, precision_);
}

void OpTable::mla_attention(const MlaAttentionArgs& in) const {
  OpProfileScope scope(profile_, OpProfile::attention);
  MlaAttentionArgs args = in;
  args.exact = exact_attention_;
  if (mla_pad_to_ == 0 || mla_pad_to_ == args.num_heads) {
    mla_attention_(args);
    return;
  }
  // PadHeads: zero query heads attend uniformly and their outputs are dropped, so the real heads'
  // results are exactly those of an unpadded run.
#ifdef MOAT_HAVE_CUDA
  if (backend_ == Backend::cuda) {  // q and out are device pointers: pad on the device
    cuda::mla_attention_pad_heads(args, mla_pad_to_, mla_attention_);
    return;
  }
#endif
  const int64_t D = args.kv_lora + args.rope_dim;
  const int64_t H = args.num_heads, P = mla_pad_to_;
  thread_local std::vector<float> q_padded, out_padded;
  q_padded.assign(static_cast<size_t>(args.num_tokens * P * D), 0.0f);
  out_padded.resize(static_cast<size_t>(args.num_tokens * P * args.kv_lora));
  for (int64_t t = 0; t < args.num_tokens; ++t)
    std::memcpy(&q_padded[t * P * D], args.q + t * H * D, sizeof(float) * H * D);
  MlaAttentionArgs padded = args;
  padded.q = q_padded.data();
  padded.num_heads = P;
  padded.out = out_padded.data();
  mla_attention_(padded);
  for (int64_t t = 0; t < args.num_tokens; ++t)
    std::memcpy(args.out + t * H * args.kv_lora, &out_padded[t * P * args.kv_lora],
                sizeof(float) * H * args.kv_lora);
}

}  // namespace moat::ops
