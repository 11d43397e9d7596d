// The signature of each op's kernels. Every backend implements the same signature, so a kernel
// choice is a function pointer picked once at load time. Pointers are in the backend's memory
// (host for reference/cpu). Shapes are row-major; T is the number of tokens in the step.
#pragma once

#include <cstdint>

#include "base/weight.h"

namespace moat::ops {

// out[T, hidden]; table [vocab, hidden] (a WeightMatrix, never fp8)
using EmbeddingFn = void (*)(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out);

// y[T, out] = x[T, in] . W^T. W streams from memory once for all T rows.
using MatmulFn = void (*)(const float* x, int64_t T, const WeightMatrix& w, float* y);

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

// Absorbed MLA attention, one query token at a time against its own sequence's latent cache.
// q[t]: [heads, D] where D = kv_lora + rope: (q_nope . W_UK) in the first kv_lora values and the
// roped q_pe in the last rope values; cache rows [kv_len[t], D]: normed latent then roped k_pe.
// score = q . row * scale over the first kv_len[t] rows (causality is the caller's kv_len),
// out[t]: [heads, kv_lora] = softmax(scores) . latent.
struct MlaAttentionArgs {
  const float* q;                 // [T, heads, D]
  int64_t num_tokens, num_heads, kv_lora, rope_dim;
  const float* const* kv_cache;   // [T] -> that token's sequence cache [>= kv_len, D]
  const int32_t* kv_len;          // [T]
  float scale;
  float* out;                     // [T, heads, kv_lora]
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
