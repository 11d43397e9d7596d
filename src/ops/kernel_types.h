// The signature of each op's kernels. Every backend implements the same signature, so a kernel
// choice is a function pointer picked once at load time. Pointers are in the backend's memory
// (host for reference/cpu). Shapes are row-major; T is the number of tokens in the step.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "base/weight.h"

namespace moat::ops {

// out[T, hidden]; table [vocab, hidden] (a WeightMatrix, never fp8)
using EmbeddingFn = void (*)(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out);

// How a matmul treats its fp32 activations. Only kernels that multiply in bf16 (the AVX-512 BF16
// CPU kernel) look at it, and the AVX2 kernel for 4-bit decode (fp8_split); the others are
// fp32-accurate always. Owned by an OpTable, so a draft and
// a target model in one process can differ.
struct MatmulPrecision {
  // Calls of at most this many tokens split x into bf16 hi + lo (two dot products per weight
  // vector, as accurate as fp32 FMAs); larger calls round x to bf16 once (~4e-3 normalized error,
  // what llama.cpp and GPU engines compute with). The default rounds every call: the split is not
  // free even in a bandwidth-bound decode GEMV. Zen 5, DeepSeek-V2-Lite-shaped bf16 checkpoint,
  // decode steps alternating between the two in one process: rounding was 0-10% faster at one
  // thread (mean +5% over 5 runs, while an A/A run differed by <= 3.5%) and +5% at two (noisier);
  // the extra dot product and x load per weight vector delay the loads that keep memory busy.
  // Batched decode feeds experts 5-16 rows, where splitting cost far more: a 64-stream decode step
  // took 488 ms instead of 376 ms (engine_bench, one run).
  int64_t split_max_tokens = 0;
  // Quantized weights (fp8, MXFP4, INT4_G32) split too (exact) instead of rounding x to bf16
  // (W8A16 / W4A16, the default; 4-bit decode-sized calls quantize x to int16 per 32 elements
  // instead, which is more accurate than bf16 and runs on integer dot products).
  bool fp8_split = false;

  static MatmulPrecision exact() { return {INT64_MAX, true}; }
};

// y[T, out] = x[T, in] . W^T. W streams from memory once for all T rows.
using MatmulFn = void (*)(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);

// The same product for `count` weights that read one x (one dtype and in_features), y[i] =
// x . w[i]^T: a layer's projections of one input (q / kv_a, gate / up, KDA's q / k / v / f_a / b /
// g). A matmul kernel may offer it (KernelEntry::group_fn): x prepared once, and every matrix's
// rows split over the pool in one dispatch, so a decode step waits at one barrier instead of
// `count`. Results equal `count` separate calls bit for bit. OpTable::matmul_group runs separate
// calls where the resolved kernel has none.
inline constexpr int64_t kMaxMatmulGroup = 8;
using MatmulGroupFn = void (*)(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                               const MatmulPrecision& precision);

// y[T, dim] (may alias x)
using RmsNormFn = void (*)(const float* x, const float* weight, int64_t T, int64_t dim, float eps,
                           float* y);

// Rotates x in place: for token t and head h the rope_dim values start at
// x + t * token_stride + h * head_stride; pair i = (v[2i], v[2i+1]) turns by the angle whose
// cos/sin are cos_table[pos * rope_dim/2 + i], sin_table[...], pos = positions[t].
struct RopeArgs {
  float* x;
  int64_t num_tokens, num_heads, token_stride, head_stride, rope_dim;
  const int32_t* positions;  // [T]
  const float* cos_table;    // [max_pos, rope_dim / 2], YaRN mscale folded in
  const float* sin_table;
};
using RopeFn = void (*)(const RopeArgs& args);

// y[T, n] = silu(gate[T, n]) * up[T, n] (y may alias gate)
using SiluMulFn = void (*)(const float* gate, const float* up, int64_t T, int64_t n, float* y);

// y[n] += alpha * x[n]
using AddScaledFn = void (*)(float* y, const float* x, float alpha, int64_t n);

// The paged MLA latent cache of one layer, FlashMLA-style: rows live in fixed-size blocks of
// block_size rows; row `slot` = block * block_size + offset holds one token's D values (normed
// latent, then roped k_pe). A block id names the same rows in every layer, so one block table
// and one slot mapping serve all layers. Pointers are in the backend's memory.
struct LatentPages {
  void* rows = nullptr;          // [num_slots, D] in dtype
  float* row_scale = nullptr;    // [num_slots]: F8_E4M3 only (value = e4m3 * scale), else nullptr
  DType dtype = DType::BF16;     // F32, BF16 or F8_E4M3
  int64_t block_size = 0;        // rows per block
};

// Writes rows[t] into slot slot_mapping[t] of the cache, converting to the cache dtype (bf16:
// round to nearest even; fp8: per-row scale = max|row| / 448, then e4m3). slot < 0 is skipped.
struct StoreLatentArgs {
  const float* rows;               // [T, D]
  int64_t num_tokens, dim;
  const int64_t* slot_mapping;     // [T]
  LatentPages cache;
};
using StoreLatentFn = void (*)(const StoreLatentArgs& args);

// Absorbed MLA attention over the paged cache. Query token t belongs to sequence token_seq[t],
// whose rows are block_tables[token_seq[t]][0..], in order; it attends to the first kv_len[t] of
// them (causality is the caller's kv_len). q[t]: [heads, D], D = kv_lora + rope: (q_nope . W_UK)
// in the first kv_lora values and the roped q_pe in the last rope values.
// score = q . row * scale, out[t]: [heads, kv_lora] = softmax(scores) . latent.
struct MlaAttentionArgs {
  const float* q;                 // [T, heads, D]
  int64_t num_tokens, num_heads, kv_lora, rope_dim;
  LatentPages cache;
  const int32_t* block_tables;    // [num_seqs, max_blocks_per_seq] block ids
  int64_t max_blocks_per_seq;
  const int32_t* token_seq;       // [T] row of block_tables
  const int32_t* kv_len;          // [T]
  float scale;
  float* out;                     // [T, heads, kv_lora]
  // fp32-accurate probabilities (OpTable sets it in --exact mode); otherwise a kernel may round
  // them to bf16 for P . V, as GPU flash attention does (cpu AMX kernel).
  bool exact = false;
};
using MlaAttentionFn = void (*)(const MlaAttentionArgs& args);

// Router: scores[T, E] are the raw gate logits (fp32). Writes topk ids/weights [T, top_k].
struct MoeRouteArgs {
  const float* logits;  // [T, E]
  const float* bias;    // [E] e_score_correction_bias (noaux_tc) or nullptr
  int64_t num_tokens, num_experts, top_k, n_group, topk_group;
  bool sigmoid;         // scoring_func: sigmoid (V3) or softmax (V2)
  bool group_limited;   // noaux_tc / group_limited_greedy: only the topk_group best groups
  bool group_score_top2_sum;  // group score: sum of its top-2 (noaux_tc) or its max (V2)
  bool norm_topk_prob;
  float routed_scaling_factor;
  int32_t* topk_ids;     // [T, top_k]
  float* topk_weights;   // [T, top_k]
};
using MoeRouteFn = void (*)(const MoeRouteArgs& args);

// ---- Kimi K3 (k3_ops: resolved when ModelOpNeeds::k3_ops is set) ------------------------------

// Kimi K3's SiTU gated activation, in every MLP (dense, shared and routed experts):
//   y[t, i] = beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta)
// with g = gate[t, i], u = up[t, i] (beta 4, linear_beta 25 in K3). y may alias gate.
using SituMulFn = void (*)(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta,
                           float* y);

// y[i] = x[i] * sigmoid(gate[i]) (K3's MLA output gate). y may alias x.
using SigmoidMulFn = void (*)(const float* x, const float* gate, int64_t n, float* y);

// Kimi K3's attention-residual mix, per token t: rows[r] are [T, dim] (a bank of earlier block
// sums and the current one);
//   score_r = sum_d rows[r][t][d] * rsqrt(mean_d(rows[r][t][d]^2) + eps) * weight[d]
//   p = softmax_r(score) (max-subtracted); out[t] = sum_r p_r * rows[r][t] (the raw rows).
// out may not alias a row.
struct AttnResMixArgs {
  const float* const* rows;   // [num_rows] host array of pointers to [T, dim] (backend memory)
  int64_t num_rows, num_tokens, dim;
  const float* weight;        // [dim]
  float eps;
  float* out;                 // [T, dim]
};
using AttnResMixFn = void (*)(const AttnResMixArgs& args);

// The gated activation of an MoE layer's experts: silu(g) * u, or K3's SiTU (SituMulFn).
enum class GatedActivation { silu, situ };

// ---- end Kimi K3 -------------------------------------------------------------------------------

// The kernels of its own backend a composite op (moe_experts, head_matmul) runs inside: the op
// table's resolved matmul per weight dtype (with the table's precision), silu_mul and add_scaled.
// So a composite op multiplies exactly as every other linear layer of the model does, and a
// faster matmul speeds it up too. Reference kernels ignore it (they compute in double).
struct InnerOps {
  const MatmulFn* matmul_by_dtype = nullptr;  // indexed by DType; nullptr where not resolved
  MatmulPrecision precision;
  SiluMulFn silu_mul = nullptr;
  AddScaledFn add_scaled = nullptr;
  SituMulFn situ_mul = nullptr;  // Kimi K3 (moe_experts with GatedActivation::situ); nullptr unless k3_ops
};

// The routed experts of one MoE layer, after moe_route:
//   out[t] += sum_k topk_weights[t, k] * down_e(act(gate_e(x[t]), up_e(x[t]))), e = topk_ids[t, k]
// act(g, u) = silu(g) * u, or with activation == situ K3's SiTU (SituMulFn, situ_beta, situ_linear_beta).
// Adds into out (the shared experts' output is already there), k in order for every token.
// Kernels group the T * top_k rows by expert, so each expert's weights stream once per call.
struct MoeExpertsArgs {
  const float* x;               // [T, hidden]
  int64_t num_tokens, hidden, top_k;
  // [T, top_k], in [0, num_experts), or -1: an expert another rank holds (expert parallelism),
  // which this call skips (its rows add nothing to out)
  const int32_t* topk_ids;
  const float* topk_weights;    // [T, top_k]
  const MlpWeights* experts;    // [num_experts] host array; gate/up [inter, hidden], down [hidden, inter]
  int64_t num_experts, intermediate;
  float* out;                   // [T, hidden]
  // Kimi K3: SiTU instead of SiLU (kernels run the InnerOps' situ_mul; the defaults are plain SiLU)
  GatedActivation activation = GatedActivation::silu;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
};
using MoeExpertsFn = void (*)(const MoeExpertsArgs& args, const InnerOps& inner);

// One small matmul per head, all heads in one call (absorbed MLA: q_nope through W_UK, the
// attention output through W_UV). For token t and head h, with x_th = x + t * x_token_stride +
// h * x_head_stride and y_th likewise:
//   y_th[0, out) = x_th[0, in) . weights[h]^T        (weights[h]: [out, in], every head alike)
//   y_th[out, out + pass) = x_th[in, in + pass)      (MLA: the roped q_pe rides along)
struct HeadMatmulArgs {
  const float* x;
  int64_t x_token_stride, x_head_stride;
  int64_t num_tokens, num_heads;
  const WeightMatrix* weights;  // [num_heads] host array (data in the backend's memory)
  float* y;
  int64_t y_token_stride, y_head_stride;
  int64_t pass = 0;
};
using HeadMatmulFn = void (*)(const HeadMatmulArgs& args, const InnerOps& inner);

// ---- Kimi Delta Attention (Kimi Linear, Kimi K3): the ops of a KDA layer ----------------------
// Several sequences run in one call, each its tokens in order: sequence s owns tokens
// [seq_start[s], seq_start[s] + seq_len[s]) of the call and carries its state (states[s]) from one
// call to the next. Every array here, the states array of pointers included, is in the backend's
// memory (a device array of device pointers on cuda).

// Causal depthwise conv1d of width W over each sequence's tokens, then SiLU. Channel c of token i
// of a sequence: y = silu(sum_{j<W} weight[c*W + j] * in[i - (W-1) + j][c]), where inputs before the
// sequence's first token in this call come from its state (the previous W-1 inputs, oldest first).
// After the call each state holds the last W-1 inputs of its sequence (oldest first), so a sequence
// can continue in the next call (decode, or a prefill split in chunks). A fresh state is all zeros.
struct ShortConvArgs {
  const float* x;  int64_t x_stride;      // [T, C] rows x_stride apart
  int64_t num_tokens, channels, width;
  const float* weight;                    // [C, W] (the checkpoint's conv1d weight [C, 1, W])
  int64_t num_seqs;
  const int32_t* seq_start;               // [S] first token of each sequence in x
  const int32_t* seq_len;                 // [S]
  float* const* states;                   // [S] each [W-1, C] fp32, updated in place
  float* y;  int64_t y_stride;            // [T, C]; must not alias x
  // Speculative verification: when set, step_states[s] [seq_len, W-1, C] receives the state after
  // each token of sequence s, so the state at an accepted position can be restored.
  float* const* step_states = nullptr;
};
using ShortConvFn = void (*)(const ShortConvArgs& args);

// Per-channel log decay of KDA, g[t, h*K + k] (<= 0), from the low-rank gate projection raw[t, H*K]:
//   lower_bound == 0 (Kimi Linear): g = -exp(a_log[h]) * softplus(raw + dt_bias[h*K + k])
//   lower_bound < 0 (Kimi K3):      g = lower_bound * sigmoid(exp(a_log[h]) * (raw + dt_bias[h*K + k]))
// softplus(x) = log(1 + exp(x)) computed stably (x for x > 20, as torch's threshold).
struct KdaGateArgs {
  const float* raw;                       // [T, H*K]
  int64_t num_tokens, num_heads, head_dim;
  const float* a_log;                     // [H]
  const float* dt_bias;                   // [H*K]
  float lower_bound;
  float* g;                               // [T, H*K], may alias raw
};
using KdaGateFn = void (*)(const KdaGateArgs& args);

// Kimi Delta Attention over each sequence's tokens in order, its state carried across calls.
// Per head h and token t: q and k are L2-normalized per head (x / sqrt(sum x^2 + 1e-6)), q is then
// scaled by K^-0.5, beta = sigmoid(beta_logit[t, h]); with the head's state S [K, V] in fp32:
//   S <- diag(exp(g_t)) S;   S <- S + beta * k (v - S^T k)^T;   o_t = S^T q
// (fla's naive_recurrent_kda with use_qk_l2norm_in_kernel). Both kda ops compute exactly this;
// kda_recurrent step by step (decode), kda_chunked with a chunked form (prefill: work per token
// independent of the context length, the state read and written once per chunk, not per token).
struct KdaArgs {
  const float* q; const float* k;         // [T, H, K] rows of H*K (qk_stride apart)
  int64_t qk_stride;
  const float* v;  int64_t v_stride;      // [T, H, V]
  const float* g;                         // [T, H, K] log decay (kda_gate's output), contiguous
  const float* beta;                      // [T, H] logits (sigmoid applied inside), contiguous
  int64_t num_tokens, num_heads, head_k, head_v;
  int64_t num_seqs;
  const int32_t* seq_start;               // [S]
  const int32_t* seq_len;                 // [S]
  float* const* states;                   // [S] each [H, K, V] fp32, updated in place
  float* out;                             // [T, H, V] contiguous
  // Speculative verification (kda_recurrent only): when set, step_states[s] [seq_len, H, K, V]
  // receives the state after each token of sequence s. kda_chunked requires it null (the model
  // asks for step states only through kda_recurrent) and fails loudly otherwise.
  float* const* step_states = nullptr;
};
using KdaFn = void (*)(const KdaArgs& args);

// KDA's output norm (fla FusedRMSNormGated, activation sigmoid), per token and head:
//   y[t, h, :] = x[t, h, :] * rsqrt(mean(x[t, h, :]^2) + eps) * weight[:] * sigmoid(gate[t, h*D + :])
struct GatedRmsNormArgs {
  const float* x;                         // [T, H, D]
  const float* gate;                      // [T, H*D]
  const float* weight;                    // [D]
  int64_t num_tokens, num_heads, head_dim;
  float eps;
  float* y;                               // [T, H, D], may alias x
};
using GatedRmsNormFn = void (*)(const GatedRmsNormArgs& args);

// probs[T, n] = softmax(x / temperature) per row (temperature > 0)
using SoftmaxFn = void (*)(const float* x, int64_t T, int64_t n, float temperature, float* probs);

// In place on probs[T, n]; per-row parameter arrays [T]
using TopKRenormFn = void (*)(float* probs, int64_t T, int64_t n, const int32_t* top_k);
using TopPRenormFn = void (*)(float* probs, int64_t T, int64_t n, const float* top_p);
using MinPRenormFn = void (*)(float* probs, int64_t T, int64_t n, const float* min_p);
// out[t] = smallest i with cumsum(probs[t])[i] > u[t] * sum(probs[t])
using SampleFromProbsFn = void (*)(const float* probs, int64_t T, int64_t n, const float* u,
                                   int32_t* out);
using ArgmaxFn = void (*)(const float* x, int64_t T, int64_t n, int32_t* out);

}  // namespace moat::ops
