// The one list of ops. Every op that model, sampling or speculative code runs is named here once;
// kernels register against these ids per backend (registry.h), and `moat doctor`, docs/ops.md and
// the parity tests all iterate this list, so nothing can be added on one side only.
#pragma once

#include <array>
#include <string_view>

namespace moat::ops {

// X(name, summary)
#define MOAT_OP_LIST(X)                                                                         \
  X(embedding, "out[T, hidden] = fp32(table[ids[t]]) (bf16/f16/f32 rows)")                     \
  X(matmul, "y[T, out] = x[T, in] . W[out, in]^T, W bf16/f16/f32, fp8 e4m3 block-scaled, or MXFP4 / INT4 per-32 scaled") \
  X(rms_norm, "y[T, dim] = x * rsqrt(mean(x^2) + eps) * weight")                                \
  X(rope, "rotate interleaved pairs of x[T, heads, rope_dim] by position (YaRN cos/sin table)") \
  X(silu_mul, "y[T, n] = silu(gate[T, n]) * up[T, n]")                                          \
  X(add_scaled, "y[n] += alpha * x[n] (residual adds, expert combine)")                         \
  X(store_latent, "write latent rows [T, D] into the paged cache by slot (bf16 / fp8 + row scale)") \
  X(mla_attention, "absorbed MLA over the paged cache: out[T, heads, kv_lora] = softmax(q.latent^T * scale) . latent") \
  X(moe_route, "router scores -> top-k experts and weights (noaux_tc groups / greedy)")         \
  X(moe_experts, "out[T, hidden] += sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) (or K3's SiTU), e = ids[t, k]") \
  X(head_matmul, "per head h: y[t, h, :out] = x[t, h, :in] . W_h^T (strided), x[t, h, in:in+pass] copied after") \
  X(short_conv, "y[T, C] = silu(causal depthwise conv1d, width W, per sequence; W-1 inputs of state each)") \
  X(kda_gate, "KDA log decay g[T, H*K] <= 0: -exp(A_log) softplus(raw + dt_bias) or lb sigmoid(...)")    \
  X(kda_recurrent, "Kimi Delta Attention step by step (decode): S <- e^g S + beta k (v - S^T k)^T, o = S^T q") \
  X(kda_chunked, "Kimi Delta Attention in chunks of tokens (prefill): kda_recurrent's outputs and state")    \
  X(gated_rms_norm, "y[T, H, D] = rms_norm(x) per head * weight * sigmoid(gate) (KDA's output norm)")     \
  X(softmax, "rows of x[T, n] -> probabilities, with temperature")                               \
  X(top_k_renorm_prob, "keep p >= k-th largest (ties kept), renormalize")                       \
  X(top_p_renorm_prob, "keep the smallest top set reaching p (ties kept), renormalize")        \
  X(min_p_renorm_prob, "keep p >= min_p * max(p), renormalize")                                 \
  X(sample_from_probs, "draw one index per row from probabilities with a uniform u")           \
  X(argmax, "index of the largest value per row (lowest index on ties)")                        \
  /* Kimi K3 (resolved when ModelOpNeeds::k3_ops) */                                            \
  X(situ_mul, "y[T, n] = b*tanh(gate/b)*sigmoid(gate) * lb*tanh(up/lb) (K3 SiTU, b 4, lb 25)")   \
  X(sigmoid_mul, "y[n] = x[n] * sigmoid(gate[n]) (K3 MLA output gate)")                          \
  X(attn_res_mix, "out[t] = sum_r softmax_r(rows[r][t] . w / rms(rows[r][t])) * rows[r][t] (K3 AttnRes)")

enum class OpId {
#define MOAT_OP_ENUM(name, summary) name,
  MOAT_OP_LIST(MOAT_OP_ENUM)
#undef MOAT_OP_ENUM
};

#define MOAT_OP_COUNT(name, summary) +1
inline constexpr int kNumOps = 0 MOAT_OP_LIST(MOAT_OP_COUNT);
#undef MOAT_OP_COUNT

inline constexpr std::array<std::string_view, kNumOps> kOpNames = {
#define MOAT_OP_NAME(name, summary) #name,
    MOAT_OP_LIST(MOAT_OP_NAME)
#undef MOAT_OP_NAME
};
inline constexpr std::array<std::string_view, kNumOps> kOpSummaries = {
#define MOAT_OP_SUMMARY(name, summary) summary,
    MOAT_OP_LIST(MOAT_OP_SUMMARY)
#undef MOAT_OP_SUMMARY
};

inline std::string_view op_name(OpId op) { return kOpNames[static_cast<int>(op)]; }

enum class Backend { reference, cpu, cuda };
inline constexpr std::array<std::string_view, 3> kBackendNames = {"reference", "cpu", "cuda"};
inline std::string_view backend_name(Backend b) { return kBackendNames[static_cast<int>(b)]; }

}  // namespace moat::ops
