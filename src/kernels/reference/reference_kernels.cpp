// Scalar reference kernels: the test oracle for every backend and the last-resort fallback for
// the cpu backend. Written for clarity and exactness (double accumulators where sums are long),
// never for speed.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "base/check.h"
#include "base/dtype.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

namespace moat::ops {
namespace {

void embedding_ref(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out) {
  const int64_t H = table.in_features;
  for (int64_t t = 0; t < T; ++t) {
    MOAT_CHECK(ids[t] >= 0 && ids[t] < table.out_features, "token id {} outside vocab {}", ids[t],
               table.out_features);
    for (int64_t j = 0; j < H; ++j) out[t * H + j] = table.at(ids[t], j);
  }
}

void matmul_ref(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision&) {
  const int64_t K = w.in_features, N = w.out_features;
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) row[k] = w.at(n, k);
    for (int64_t t = 0; t < T; ++t) {
      double acc = 0.0;
      const float* xt = x + t * K;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(xt[k]) * row[k];
      y[t * N + n] = static_cast<float>(acc);
    }
  }
}

void rms_norm_ref(const float* x, const float* weight, int64_t T, int64_t dim, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0.0;
    for (int64_t j = 0; j < dim; ++j) ss += static_cast<double>(x[t * dim + j]) * x[t * dim + j];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int64_t j = 0; j < dim; ++j) y[t * dim + j] = x[t * dim + j] * inv * weight[j];
  }
}

void rope_ref(const RopeArgs& a) {
  const int64_t half = a.rope_dim / 2;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const float* c = a.cos_table + static_cast<int64_t>(a.positions[t]) * half;
    const float* s = a.sin_table + static_cast<int64_t>(a.positions[t]) * half;
    for (int64_t h = 0; h < a.num_heads; ++h) {
      float* v = a.x + t * a.token_stride + h * a.head_stride;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * c[i] - x1 * s[i];
        v[2 * i + 1] = x0 * s[i] + x1 * c[i];
      }
    }
  }
}

void silu_mul_ref(const float* gate, const float* up, int64_t T, int64_t n, float* y) {
  for (int64_t i = 0; i < T * n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add_scaled_ref(float* y, const float* x, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// fp8 e4m3's largest finite value: a row's scale maps its largest magnitude there.
constexpr float kFp8Max = 448.0f;

void store_latent_ref(const StoreLatentArgs& a) {
  const LatentPages& c = a.cache;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    const float* src = a.rows + t * a.dim;
    switch (c.dtype) {
      case DType::F32:
        std::copy(src, src + a.dim, static_cast<float*>(c.rows) + slot * a.dim);
        break;
      case DType::BF16: {
        uint16_t* dst = static_cast<uint16_t*>(c.rows) + slot * a.dim;
        for (int64_t d = 0; d < a.dim; ++d) dst[d] = f32_to_bf16(src[d]);
        break;
      }
      case DType::F8_E4M3: {
        float amax = 0.0f;
        for (int64_t d = 0; d < a.dim; ++d) amax = std::max(amax, std::fabs(src[d]));
        const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        uint8_t* dst = static_cast<uint8_t*>(c.rows) + slot * a.dim;
        for (int64_t d = 0; d < a.dim; ++d) dst[d] = f32_to_fp8_e4m3(src[d] / scale);
        c.row_scale[slot] = scale;
        break;
      }
      default: MOAT_CHECK(false, "store_latent: unsupported cache dtype {}", dtype_name(c.dtype));
    }
  }
}

// Row `slot` of the cache as fp32 values.
void read_latent_row(const LatentPages& c, int64_t slot, int64_t dim, float* out) {
  switch (c.dtype) {
    case DType::F32: std::copy_n(static_cast<const float*>(c.rows) + slot * dim, dim, out); break;
    case DType::BF16:
      for (int64_t d = 0; d < dim; ++d) out[d] = bf16_to_f32(static_cast<const uint16_t*>(c.rows)[slot * dim + d]);
      break;
    case DType::F8_E4M3:
      for (int64_t d = 0; d < dim; ++d)
        out[d] = fp8_e4m3_to_f32(static_cast<const uint8_t*>(c.rows)[slot * dim + d]) * c.row_scale[slot];
      break;
    default: MOAT_CHECK(false, "mla_attention: unsupported cache dtype {}", dtype_name(c.dtype));
  }
}

void mla_attention_ref(const MlaAttentionArgs& a) {
  const int64_t D = a.kv_lora + a.rope_dim, B = a.cache.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int32_t* blocks = a.block_tables + static_cast<int64_t>(a.token_seq[t]) * a.max_blocks_per_seq;
    const int64_t L = a.kv_len[t];
    MOAT_CHECK(L <= a.max_blocks_per_seq * B, "kv_len {} beyond the block table ({} blocks of {})", L,
               a.max_blocks_per_seq, B);
    // This token's context, gathered from its blocks: [L, D]
    std::vector<float> cache(static_cast<size_t>(L * D));
    for (int64_t j = 0; j < L; ++j) read_latent_row(a.cache, blocks[j / B] * B + j % B, D, &cache[j * D]);
    std::vector<double> scores(static_cast<size_t>(L));
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const float* q = a.q + (t * a.num_heads + h) * D;
      double max_score = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        double s = 0.0;
        for (int64_t d = 0; d < D; ++d) s += static_cast<double>(q[d]) * cache[j * D + d];
        scores[j] = s * a.scale;
        max_score = std::max(max_score, scores[j]);
      }
      double denom = 0.0;
      for (int64_t j = 0; j < L; ++j) denom += (scores[j] = std::exp(scores[j] - max_score));
      float* out = a.out + (t * a.num_heads + h) * a.kv_lora;
      for (int64_t d = 0; d < a.kv_lora; ++d) {
        double acc = 0.0;
        for (int64_t j = 0; j < L; ++j) acc += scores[j] * cache[j * D + d];
        out[d] = static_cast<float>(acc / denom);
      }
    }
  }
}

// Indices of the k largest values, highest first; ties go to the lower index (torch.topk's
// behaviour on CPU for distinct values; documented so the reference model matches).
std::vector<int64_t> top_indices(const std::vector<float>& v, int64_t k) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  idx.resize(static_cast<size_t>(std::min<int64_t>(k, static_cast<int64_t>(v.size()))));
  return idx;
}

void moe_route_ref(const MoeRouteArgs& a) {
  const int64_t E = a.num_experts;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const float* logits = a.logits + t * E;
    std::vector<float> scores(static_cast<size_t>(E));
    if (a.sigmoid) {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    } else {
      const float m = *std::max_element(logits, logits + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(logits[e] - m));
      for (int64_t e = 0; e < E; ++e) scores[e] = static_cast<float>(scores[e] / sum);
    }
    std::vector<float> choice = scores;  // what selection ranks: biased for noaux_tc
    if (a.bias)
      for (int64_t e = 0; e < E; ++e) choice[e] += a.bias[e];
    if (a.group_limited && a.n_group > 1) {
      const int64_t per_group = E / a.n_group;
      std::vector<float> group_score(static_cast<size_t>(a.n_group));
      for (int64_t g = 0; g < a.n_group; ++g) {
        std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
        auto top = top_indices(members, a.group_score_top2_sum ? 2 : 1);
        float s = 0.0f;
        for (int64_t i : top) s += members[i];
        group_score[g] = s;
      }
      auto keep = top_indices(group_score, a.topk_group);
      std::vector<bool> kept(static_cast<size_t>(a.n_group), false);
      for (int64_t g : keep) kept[g] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / per_group]) choice[e] = -INFINITY;
    }
    auto chosen = top_indices(choice, a.top_k);
    double sum = 0.0;
    for (int64_t i = 0; i < a.top_k; ++i) sum += scores[chosen[i]];
    for (int64_t i = 0; i < a.top_k; ++i) {
      float w = scores[chosen[i]];
      if (a.norm_topk_prob && a.top_k > 1) w = static_cast<float>(w / (sum + 1e-20));
      a.topk_ids[t * a.top_k + i] = static_cast<int32_t>(chosen[i]);
      a.topk_weights[t * a.top_k + i] = w * a.routed_scaling_factor;
    }
  }
}

void softmax_ref(const float* x, int64_t T, int64_t n, float temperature, float* probs) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * n;
    float* p = probs + t * n;
    const float m = *std::max_element(row, row + n);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += (p[i] = std::exp((row[i] - m) / temperature));
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] / sum);
  }
}

void renormalize(float* p, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += p[i];
  const double denom = std::max(sum, 1e-8);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] / denom);
}

void top_k_renorm_ref(float* probs, int64_t T, int64_t n, const int32_t* top_k) {
  for (int64_t t = 0; t < T; ++t) {
    float* p = probs + t * n;
    const int64_t k = top_k[t];
    if (k > 0 && k < n) {
      std::vector<float> sorted(p, p + n);
      std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
      const float kth = sorted[k - 1];
      for (int64_t i = 0; i < n; ++i)
        if (p[i] < kth) p[i] = 0.0f;
    }
    renormalize(p, n);
  }
}

void top_p_renorm_ref(float* probs, int64_t T, int64_t n, const float* top_p) {
  for (int64_t t = 0; t < T; ++t) {
    float* p = probs + t * n;
    if (top_p[t] < 1.0f) {
      std::vector<float> sorted(p, p + n);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      double total = 0.0;
      for (float v : sorted) total += v;
      double cum = 0.0;
      float threshold = sorted.back();
      for (float v : sorted) {
        cum += v;
        if (cum >= top_p[t] * total) {
          threshold = v;
          break;
        }
      }
      for (int64_t i = 0; i < n; ++i)
        if (p[i] < threshold) p[i] = 0.0f;
    }
    renormalize(p, n);
  }
}

void min_p_renorm_ref(float* probs, int64_t T, int64_t n, const float* min_p) {
  for (int64_t t = 0; t < T; ++t) {
    float* p = probs + t * n;
    if (min_p[t] > 0.0f) {
      const float threshold = min_p[t] * *std::max_element(p, p + n);
      for (int64_t i = 0; i < n; ++i)
        if (p[i] < threshold) p[i] = 0.0f;
    }
    renormalize(p, n);
  }
}

void sample_from_probs_ref(const float* probs, int64_t T, int64_t n, const float* u, int32_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs + t * n;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += p[i];
    const double target = static_cast<double>(u[t]) * total;
    double cum = 0.0;
    int32_t pick = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] <= 0.0f) continue;
      pick = static_cast<int32_t>(i);  // last nonzero, in case rounding leaves cum < target
      cum += p[i];
      if (cum > target) break;
    }
    MOAT_CHECK(pick >= 0, "sampling from an all-zero distribution (row {})", t);
    out[t] = pick;
  }
}

// Each token through each of its experts in turn, in double: the oracle for the grouped kernels.
void moe_experts_ref(const MoeExpertsArgs& a, const InnerOps&) {
  const int64_t H = a.hidden, I = a.intermediate;
  std::vector<double> act(static_cast<size_t>(I)), y(static_cast<size_t>(H));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const float* xt = a.x + t * H;
    std::fill(y.begin(), y.end(), 0.0);
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int32_t e = a.topk_ids[t * a.top_k + k];
      if (e == -1) continue;  // held by another rank
      MOAT_CHECK(e >= 0 && e < a.num_experts, "expert id {} outside {} experts", e, a.num_experts);
      const MlpWeights& w = a.experts[e];
      for (int64_t i = 0; i < I; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t j = 0; j < H; ++j) {
          g += static_cast<double>(xt[j]) * w.gate_proj.at(i, j);
          u += static_cast<double>(xt[j]) * w.up_proj.at(i, j);
        }
        if (a.activation == GatedActivation::situ) {  // Kimi K3's SiTU
          const double b = a.situ_beta, lb = a.situ_linear_beta;
          act[i] = b * std::tanh(g / b) / (1.0 + std::exp(-g)) * (lb * std::tanh(u / lb));
        } else {
          act[i] = g / (1.0 + std::exp(-g)) * u;
        }
      }
      const double weight = a.topk_weights[t * a.top_k + k];
      for (int64_t j = 0; j < H; ++j) {
        double d = 0.0;
        for (int64_t i = 0; i < I; ++i) d += act[i] * w.down_proj.at(j, i);
        y[j] += weight * d;
      }
    }
    for (int64_t j = 0; j < H; ++j) a.out[t * H + j] += static_cast<float>(y[j]);
  }
}

void head_matmul_ref(const HeadMatmulArgs& a, const InnerOps&) {
  for (int64_t h = 0; h < a.num_heads; ++h) {
    const WeightMatrix& w = a.weights[h];
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const float* x = a.x + t * a.x_token_stride + h * a.x_head_stride;
      float* y = a.y + t * a.y_token_stride + h * a.y_head_stride;
      for (int64_t n = 0; n < w.out_features; ++n) {
        double acc = 0.0;
        for (int64_t k = 0; k < w.in_features; ++k) acc += static_cast<double>(x[k]) * w.at(n, k);
        y[n] = static_cast<float>(acc);
      }
      for (int64_t i = 0; i < a.pass; ++i) y[w.out_features + i] = x[w.in_features + i];
    }
  }
}

void argmax_ref(const float* x, int64_t T, int64_t n, int32_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * n;
    out[t] = static_cast<int32_t>(std::max_element(row, row + n) - row);
  }
}

}  // namespace

void register_reference_kda_kernels(Registry& registry);  // kda_reference.cpp
void register_reference_k3_kernels(Registry& r);  // k3_reference_kernels.cpp

void register_reference_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn, Constraints c = {}) {
    r.add(KernelEntry{op, Backend::reference, name, fn, std::move(c), 0, {Backend::cpu}});
  };
  const Constraints any_weight{.weight_dtypes = {DType::BF16, DType::F16, DType::F32}};
  const Constraints any_linear{
      .weight_dtypes = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32}};
  add(OpId::embedding, "reference.embedding", reinterpret_cast<void*>(&embedding_ref), any_weight);
  add(OpId::matmul, "reference.matmul", reinterpret_cast<void*>(&matmul_ref), any_linear);
  add(OpId::rms_norm, "reference.rms_norm", reinterpret_cast<void*>(&rms_norm_ref));
  add(OpId::rope, "reference.rope", reinterpret_cast<void*>(&rope_ref));
  add(OpId::silu_mul, "reference.silu_mul", reinterpret_cast<void*>(&silu_mul_ref));
  add(OpId::add_scaled, "reference.add_scaled", reinterpret_cast<void*>(&add_scaled_ref));
  const Constraints any_kv{.kv_dtypes = {DType::F32, DType::BF16, DType::F8_E4M3}};
  add(OpId::store_latent, "reference.store_latent", reinterpret_cast<void*>(&store_latent_ref), any_kv);
  add(OpId::mla_attention, "reference.mla_attention", reinterpret_cast<void*>(&mla_attention_ref), any_kv);
  add(OpId::moe_route, "reference.moe_route", reinterpret_cast<void*>(&moe_route_ref));
  add(OpId::moe_experts, "reference.moe_experts", reinterpret_cast<void*>(&moe_experts_ref), any_linear);
  add(OpId::head_matmul, "reference.head_matmul", reinterpret_cast<void*>(&head_matmul_ref), any_linear);
  add(OpId::softmax, "reference.softmax", reinterpret_cast<void*>(&softmax_ref));
  add(OpId::top_k_renorm_prob, "reference.top_k_renorm_prob", reinterpret_cast<void*>(&top_k_renorm_ref));
  add(OpId::top_p_renorm_prob, "reference.top_p_renorm_prob", reinterpret_cast<void*>(&top_p_renorm_ref));
  add(OpId::min_p_renorm_prob, "reference.min_p_renorm_prob", reinterpret_cast<void*>(&min_p_renorm_ref));
  add(OpId::sample_from_probs, "reference.sample_from_probs", reinterpret_cast<void*>(&sample_from_probs_ref));
  add(OpId::argmax, "reference.argmax", reinterpret_cast<void*>(&argmax_ref));
  register_reference_kda_kernels(r);
  // Kimi K3: situ_mul, sigmoid_mul, attn_res_mix
  register_reference_k3_kernels(r);
}

}  // namespace moat::ops
