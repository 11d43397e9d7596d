#include "models/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/log.h"
#include "base/thread_pool.h"
#include "loader/weight_map.h"
#include "models/op_needs.h"

namespace moat {

namespace {

std::string layer_prefix(int64_t i) { return fmt::format("model.layers.{}.", i); }

}  // namespace

Result<std::unique_ptr<DeepseekModel>> DeepseekModel::load(const std::filesystem::path& dir,
                                                           const Options& options) {
  std::unique_ptr<DeepseekModel> model(new DeepseekModel());
  model->options_ = options;
  MOAT_ASSIGN_OR_RETURN(model->config_, load_model_config(dir));
  MOAT_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(dir, options.weights));
  model->checkpoint_ = std::make_unique<Checkpoint>(std::move(checkpoint));
  MOAT_TRY(validate_checkpoint(*model->checkpoint_, model->config_));
  MOAT_ASSIGN_OR_RETURN(ops::ModelOpNeeds needs, model_op_needs(model->config_, 1, options.kv_dtype));
  MOAT_ASSIGN_OR_RETURN(model->ops_, ops::OpTable::resolve(options.backend, needs));
  if (options.max_context <= 0) return make_error("max context must be > 0, got {}", options.max_context);
  model->ops_.set_exact_activations(options.exact_activations);
  model->rope_ = build_rope_table(model->config_, options.max_context);
  model->softmax_scale_ = static_cast<float>(model->config_.softmax_scale());
  MOAT_TRY(model->load_weights());
  return model;
}

Status DeepseekModel::load_weights() {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  const int64_t H = c.hidden_size, heads = c.num_attention_heads;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vdim = c.v_head_dim;
  const int64_t kv_lora = c.kv_lora_rank;

  MOAT_ASSIGN_OR_RETURN(embed_tokens_, get_matrix(ck, "model.embed_tokens.weight", c.vocab_size, H, c));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_tokens_;
  } else {
    MOAT_ASSIGN_OR_RETURN(lm_head_, get_matrix(ck, "lm_head.weight", c.vocab_size, H, c));
  }
  MOAT_ASSIGN_OR_RETURN(final_norm_, get_vector_f32(ck, "model.norm.weight", H));

  auto load_mlp = [&](const std::string& prefix, int64_t inter) -> Result<MlpWeights> {
    MlpWeights m;
    MOAT_ASSIGN_OR_RETURN(m.gate_proj, get_matrix(ck, prefix + "gate_proj.weight", inter, H, c));
    MOAT_ASSIGN_OR_RETURN(m.up_proj, get_matrix(ck, prefix + "up_proj.weight", inter, H, c));
    MOAT_ASSIGN_OR_RETURN(m.down_proj, get_matrix(ck, prefix + "down_proj.weight", H, inter, c));
    return m;
  };

  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& L = layers_[i];
    const std::string p = layer_prefix(i);
    MOAT_ASSIGN_OR_RETURN(L.input_layernorm, get_vector_f32(ck, p + "input_layernorm.weight", H));
    MOAT_ASSIGN_OR_RETURN(L.post_attention_layernorm, get_vector_f32(ck, p + "post_attention_layernorm.weight", H));
    MlaWeights& A = L.attn;
    const std::string a = p + "self_attn.";
    if (c.q_lora_rank) {
      MOAT_ASSIGN_OR_RETURN(A.q_a_proj, get_matrix(ck, a + "q_a_proj.weight", *c.q_lora_rank, H, c));
      MOAT_ASSIGN_OR_RETURN(A.q_a_layernorm, get_vector_f32(ck, a + "q_a_layernorm.weight", *c.q_lora_rank));
      MOAT_ASSIGN_OR_RETURN(A.q_b_proj, get_matrix(ck, a + "q_b_proj.weight", heads * (nope + rope), *c.q_lora_rank, c));
    } else {
      MOAT_ASSIGN_OR_RETURN(A.q_proj, get_matrix(ck, a + "q_proj.weight", heads * (nope + rope), H, c));
    }
    MOAT_ASSIGN_OR_RETURN(A.kv_a_proj_with_mqa, get_matrix(ck, a + "kv_a_proj_with_mqa.weight", kv_lora + rope, H, c));
    MOAT_ASSIGN_OR_RETURN(A.kv_a_layernorm, get_vector_f32(ck, a + "kv_a_layernorm.weight", kv_lora));
    MOAT_ASSIGN_OR_RETURN(A.kv_b_proj, get_matrix(ck, a + "kv_b_proj.weight", heads * (nope + vdim), kv_lora, c));
    MOAT_ASSIGN_OR_RETURN(A.o_proj, get_matrix(ck, a + "o_proj.weight", H, heads * vdim, c));

    // W_UK^T per head: [kv_lora, nope]. Exact in bf16 when kv_b is bf16; fp8 kv_b gets bf16
    // copies too unless activations are exact (the copies are read every decode step, and fp32
    // ones doubled their bytes against what W8A16 computes with anyway).
    const bool keep_bf16 = A.kv_b_proj.dtype == DType::BF16 ||
                           (A.kv_b_proj.dtype == DType::F8_E4M3 && !options_.exact_activations);
    const size_t n = static_cast<size_t>(heads * kv_lora * nope);
    if (keep_bf16) A.w_uk_t_bf16.resize(n); else A.w_uk_t_f32.resize(n);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < nope; ++r)
        for (int64_t col = 0; col < kv_lora; ++col) {
          const float v = A.kv_b_proj.at(h * (nope + vdim) + r, col);
          const size_t dst = static_cast<size_t>((h * kv_lora + col) * nope + r);
          if (keep_bf16) A.w_uk_t_bf16[dst] = f32_to_bf16(v); else A.w_uk_t_f32[dst] = v;
        }
    }
    if (A.kv_b_proj.dtype == DType::F8_E4M3) {
      const size_t uv = static_cast<size_t>(heads * vdim * kv_lora);
      if (keep_bf16) A.w_uv_bf16.resize(uv); else A.w_uv_f32.resize(uv);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t r = 0; r < vdim; ++r)
          for (int64_t col = 0; col < kv_lora; ++col) {
            const float v = A.kv_b_proj.at(h * (nope + vdim) + nope + r, col);
            const size_t dst = static_cast<size_t>((h * vdim + r) * kv_lora + col);
            if (keep_bf16) A.w_uv_bf16[dst] = f32_to_bf16(v); else A.w_uv_f32[dst] = v;
          }
    }
    for (int64_t h = 0; h < heads; ++h) {
      WeightMatrix w;
      w.dtype = keep_bf16 ? DType::BF16 : DType::F32;
      w.data = keep_bf16 ? static_cast<const void*>(A.w_uk_t_bf16.data() + h * kv_lora * nope)
                         : static_cast<const void*>(A.w_uk_t_f32.data() + h * kv_lora * nope);
      w.out_features = kv_lora;
      w.in_features = nope;
      A.w_uk_t.push_back(w);
      // W_UV of head h: rows of kv_b_proj [v, kv_lora]. fp8 row slices would have to start on a
      // scale block, which they generally don't, so fp8 checkpoints get a dequantized copy.
      const int64_t row0 = h * (nope + vdim) + nope;
      if (A.kv_b_proj.dtype == DType::F8_E4M3) {
        WeightMatrix uv;
        uv.dtype = keep_bf16 ? DType::BF16 : DType::F32;
        uv.data = keep_bf16 ? static_cast<const void*>(A.w_uv_bf16.data() + h * vdim * kv_lora)
                            : static_cast<const void*>(A.w_uv_f32.data() + h * vdim * kv_lora);
        uv.out_features = vdim;
        uv.in_features = kv_lora;
        A.w_uv.push_back(uv);
      } else {
        A.w_uv.push_back(A.kv_b_proj.rows(row0, vdim));
      }
    }

    if (c.is_moe_layer(i)) {
      MoeWeights moe;
      MOAT_ASSIGN_OR_RETURN(moe.gate, get_matrix(ck, p + "mlp.gate.weight", c.n_routed_experts, H, c));
      if (c.topk_method == "noaux_tc") {
        MOAT_ASSIGN_OR_RETURN(moe.score_bias, get_vector_f32(ck, p + "mlp.gate.e_score_correction_bias", c.n_routed_experts));
      }
      moe.experts.reserve(static_cast<size_t>(c.n_routed_experts));
      for (int64_t e = 0; e < c.n_routed_experts; ++e) {
        MOAT_ASSIGN_OR_RETURN(MlpWeights expert, load_mlp(fmt::format("{}mlp.experts.{}.", p, e), c.moe_intermediate_size));
        moe.experts.push_back(expert);
      }
      if (c.n_shared_experts > 0) {
        MOAT_ASSIGN_OR_RETURN(moe.shared, load_mlp(p + "mlp.shared_experts.", c.n_shared_experts * c.moe_intermediate_size));
      }
      L.moe = std::move(moe);
    } else {
      MOAT_ASSIGN_OR_RETURN(L.dense_mlp, load_mlp(p + "mlp.", c.intermediate_size));
    }
  }
  return ok_status();
}

void DeepseekModel::reserve(int64_t T) {
  if (T <= reserved_tokens_) return;
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, heads = c.num_attention_heads;
  const int64_t qk = c.qk_head_dim(), D = c.kv_cache_dim();
  const int64_t inter = std::max({c.intermediate_size, c.moe_intermediate_size * std::max<int64_t>(1, c.n_shared_experts),
                                  c.moe_intermediate_size});
  auto grow = [](Buffer& b, int64_t n) { b.resize(static_cast<size_t>(n)); };
  grow(x_, T * H);
  grow(h_, T * H);
  grow(tmp_, T * H);
  grow(q_, T * heads * qk);
  grow(q_lora_, T * c.q_lora_rank.value_or(1));
  grow(kv_, T * D);
  grow(q_full_, T * heads * D);
  grow(attn_latent_, T * heads * c.kv_lora_rank);
  grow(attn_v_, T * heads * c.v_head_dim);
  grow(head_in_, heads * T * std::max(c.kv_lora_rank, c.qk_nope_head_dim));
  grow(head_out_, heads * T * std::max(c.kv_lora_rank, c.v_head_dim));
  grow(mlp_gate_, T * inter);
  grow(mlp_up_, T * inter);
  const int64_t routed_rows = T * std::max<int64_t>(1, c.num_experts_per_tok);
  grow(expert_in_, routed_rows * H);
  grow(expert_out_, routed_rows * H);
  grow(expert_gate_, routed_rows * c.moe_intermediate_size);
  grow(expert_up_, routed_rows * c.moe_intermediate_size);
  routed_token_.resize(static_cast<size_t>(routed_rows));
  routed_weight_.resize(static_cast<size_t>(routed_rows));
  grow(router_logits_, T * std::max<int64_t>(1, c.n_routed_experts));
  grow(logits_in_, T * H);
  topk_ids_.resize(static_cast<size_t>(T * std::max<int64_t>(1, c.num_experts_per_tok)));
  topk_weights_.resize(topk_ids_.size());
  grow(latent_rows_, T * D);
  kv_lens_.resize(static_cast<size_t>(T));
  reserved_tokens_ = T;
}

void DeepseekModel::forward(const ForwardBatch& batch, PagedLatentCache& cache, float* logits,
                            const LayerHook& on_layer_output) {
  const ModelConfig& c = config_;
  const int64_t T = batch.num_tokens();
  MOAT_CHECK(batch.positions.size() == batch.tokens.size() && batch.slot_mapping.size() == batch.tokens.size() &&
                 batch.token_seq.size() == batch.tokens.size(),
             "batch arrays disagree in length");
  MOAT_CHECK(batch.block_size == cache.block_size(), "batch block size {} but the cache's is {}", batch.block_size,
             cache.block_size());
  MOAT_CHECK(cache.shape().num_layers == c.num_hidden_layers && cache.shape().dim == c.kv_cache_dim(),
             "cache shaped for {} layers x {} values, model has {} x {}", cache.shape().num_layers,
             cache.shape().dim, c.num_hidden_layers, c.kv_cache_dim());
  MOAT_CHECK(cache.shape().dtype == options_.kv_dtype, "cache dtype {} but ops resolved for {}",
             dtype_name(cache.shape().dtype), dtype_name(options_.kv_dtype));
  const int64_t slots = static_cast<int64_t>(cache.num_blocks()) * cache.block_size();
  for (int64_t t = 0; t < T; ++t) {
    MOAT_CHECK(batch.positions[t] >= 0 && batch.positions[t] < options_.max_context,
               "position {} outside max context {}", batch.positions[t], options_.max_context);
    MOAT_CHECK(batch.slot_mapping[t] >= 0 && batch.slot_mapping[t] < slots, "slot {} outside the cache's {}",
               batch.slot_mapping[t], slots);
  }
  reserve(T);
  const int64_t H = c.hidden_size;
  float* x = x_.data();  // residual stream [T, hidden]
  float* h = h_.data();  // normed input of the current sublayer [T, hidden]
  ops_.embedding(embed_tokens_, batch.tokens.data(), T, x);

  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& L = layers_[i];
    ops_.rms_norm(x, L.input_layernorm.data(), T, H, static_cast<float>(c.rms_norm_eps), h);
    attention(L, i, batch, cache, h, tmp_.data());
    ops_.add_scaled(x, tmp_.data(), 1.0f, T * H);
    ops_.rms_norm(x, L.post_attention_layernorm.data(), T, H, static_cast<float>(c.rms_norm_eps), h);
    if (L.moe) {
      moe(*L.moe, h, T, tmp_.data());
    } else {
      mlp(*L.dense_mlp, h, T, tmp_.data(), mlp_gate_.data(), mlp_up_.data());
    }
    ops_.add_scaled(x, tmp_.data(), 1.0f, T * H);
    if (on_layer_output) on_layer_output(i, x, T);
  }

  // Only the rows that need logits go through the final norm and lm_head.
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  for (int64_t r = 0; r < R; ++r) {
    const int32_t row = batch.logit_rows[r];
    MOAT_CHECK(row >= 0 && row < T, "logit row {} outside batch of {}", row, T);
    std::memcpy(logits_in_.data() + r * H, x + row * H, sizeof(float) * H);
  }
  ops_.rms_norm(logits_in_.data(), final_norm_.data(), R, H, static_cast<float>(c.rms_norm_eps), logits_in_.data());
  ops_.matmul(logits_in_.data(), R, lm_head_, logits);
}

void DeepseekModel::attention(const LayerWeights& layer, int64_t layer_index, const ForwardBatch& batch,
                              PagedLatentCache& cache, const float* x, float* out) {
  const ModelConfig& c = config_;
  const MlaWeights& A = layer.attn;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t heads = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t qk = nope + rope, kv_lora = c.kv_lora_rank, D = kv_lora + rope, vdim = c.v_head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // q: [T, heads, nope + rope]
  float* q = q_.data();
  if (A.q_a_proj) {
    const int64_t ql = *c.q_lora_rank;
    ops_.matmul(x, T, *A.q_a_proj, q_lora_.data());                    // [T, q_lora]
    ops_.rms_norm(q_lora_.data(), A.q_a_layernorm.data(), T, ql, eps, q_lora_.data());
    ops_.matmul(q_lora_.data(), T, *A.q_b_proj, q);
  } else {
    ops_.matmul(x, T, *A.q_proj, q);
  }
  // kv: [T, kv_lora + rope] -> the cache rows of this layer: normed latent, roped k_pe
  float* kv = kv_.data();
  ops_.matmul(x, T, A.kv_a_proj_with_mqa, kv);
  ops_.rope({kv + kv_lora, T, 1, D, D, rope, batch.positions.data(), rope_.cos.data(), rope_.sin.data()});
  ops_.rope({q + nope, T, heads, heads * qk, qk, rope, batch.positions.data(), rope_.cos.data(), rope_.sin.data()});
  // latent rows [T, D]: normed latent, then the roped k_pe, written into the cache by slot
  float* rows = latent_rows_.data();
  for (int64_t t = 0; t < T; ++t) {
    ops_.rms_norm(kv + t * D, A.kv_a_layernorm.data(), 1, kv_lora, eps, rows + t * D);
    std::memcpy(rows + t * D + kv_lora, kv + t * D + kv_lora, sizeof(float) * rope);
    kv_lens_[t] = batch.positions[t] + 1;
  }
  const ops::LatentPages pages = cache.layer(layer_index);
  ops_.store_latent({rows, T, D, batch.slot_mapping.data(), pages});

  // Absorb W_UK: q_full[t, h] = [q_nope[t, h] . W_UK_h (kv_lora) | q_pe[t, h] (rope)].
  // Heads run in parallel (each head's small matmul then runs on one thread), which costs one
  // pool dispatch per layer instead of one per head: that overhead matters at decode.
  float* q_full = q_full_.data();
  float* head_in = head_in_.data();    // [heads, T, max(nope, kv_lora)]
  float* head_out = head_out_.data();  // [heads, T, max(kv_lora, v)]
  const int64_t in_stride = T * std::max(kv_lora, nope), out_stride = T * std::max(kv_lora, vdim);
  thread_pool().parallel_for(heads, [&](int64_t h0, int64_t h1) {
    for (int64_t hd = h0; hd < h1; ++hd) {
      float* in = head_in + hd * in_stride;
      float* res = head_out + hd * out_stride;
      for (int64_t t = 0; t < T; ++t) std::memcpy(in + t * nope, q + (t * heads + hd) * qk, sizeof(float) * nope);
      ops_.matmul(in, T, A.w_uk_t[hd], res);  // [T, kv_lora]
      for (int64_t t = 0; t < T; ++t) {
        float* dst = q_full + (t * heads + hd) * D;
        std::memcpy(dst, res + t * kv_lora, sizeof(float) * kv_lora);
        std::memcpy(dst + kv_lora, q + (t * heads + hd) * qk + nope, sizeof(float) * rope);
      }
    }
  });

  ops::MlaAttentionArgs args{q_full, T, heads, kv_lora, rope, pages, batch.block_tables.data(), batch.max_blocks,
                             batch.token_seq.data(), kv_lens_.data(), softmax_scale_, attn_latent_.data()};
  ops_.mla_attention(args);  // [T, heads, kv_lora]

  // Expand through W_UV per head: attn_v[t, h] = latent[t, h] . W_UV_h^T (v values)
  thread_pool().parallel_for(heads, [&](int64_t h0, int64_t h1) {
    for (int64_t hd = h0; hd < h1; ++hd) {
      float* in = head_in + hd * in_stride;
      float* res = head_out + hd * out_stride;
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(in + t * kv_lora, attn_latent_.data() + (t * heads + hd) * kv_lora, sizeof(float) * kv_lora);
      ops_.matmul(in, T, A.w_uv[hd], res);  // [T, v]
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(attn_v_.data() + (t * heads + hd) * vdim, res + t * vdim, sizeof(float) * vdim);
    }
  });
  ops_.matmul(attn_v_.data(), T, A.o_proj, out);  // [T, hidden]
}

void DeepseekModel::mlp(const MlpWeights& w, const float* x, int64_t T, float* out, float* gate, float* up) {
  const int64_t n = w.gate_proj.out_features;
  ops_.matmul(x, T, w.gate_proj, gate);  // [T, n]
  ops_.matmul(x, T, w.up_proj, up);      // [T, n]
  ops_.silu_mul(gate, up, T, n, gate);
  ops_.matmul(gate, T, w.down_proj, out);  // [T, hidden]
}

void DeepseekModel::moe(const MoeWeights& w, const float* x, int64_t T, float* out) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t inter = c.moe_intermediate_size;
  ops_.matmul(x, T, w.gate, router_logits_.data());  // [T, E] router logits in fp32
  ops::MoeRouteArgs route{router_logits_.data(),
                          w.score_bias.empty() ? nullptr : w.score_bias.data(),
                          T, E, K, c.n_group, c.topk_group,
                          c.scoring_func == "sigmoid",
                          c.topk_method == "noaux_tc" || c.topk_method == "group_limited_greedy",
                          c.topk_method == "noaux_tc",
                          c.norm_topk_prob,
                          static_cast<float>(c.routed_scaling_factor),
                          topk_ids_.data(), topk_weights_.data()};
  ops_.moe_route(route);

  // Shared experts see every token, unscaled.
  if (w.shared) {
    mlp(*w.shared, x, T, out, mlp_gate_.data(), mlp_up_.data());
  } else {
    std::fill(out, out + T * H, 0.0f);
  }

  // Group the T*K routed rows by expert (counting sort), so each expert's weights stream from
  // memory once per step: rows [expert_begin[e], expert_begin[e+1]) of the scratch belong to e.
  expert_begin_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < T * K; ++i) ++expert_begin_[topk_ids_[i] + 1];
  for (int64_t e = 0; e < E; ++e) expert_begin_[e + 1] += expert_begin_[e];
  std::vector<int64_t>& fill = expert_fill_;
  fill.assign(expert_begin_.begin(), expert_begin_.end() - 1);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t row = fill[topk_ids_[i]]++;
    routed_token_[row] = static_cast<int32_t>(i / K);
    routed_weight_[row] = topk_weights_[i];
    std::memcpy(expert_in_.data() + row * H, x + (i / K) * H, sizeof(float) * H);
  }
  active_experts_.clear();
  for (int64_t e = 0; e < E; ++e)
    if (expert_begin_[e + 1] > expert_begin_[e]) active_experts_.push_back(static_cast<int32_t>(e));

  auto run_expert = [&](int32_t e) {
    const int64_t row0 = expert_begin_[e], rows = expert_begin_[e + 1] - row0;
    mlp(w.experts[e], expert_in_.data() + row0 * H, rows, expert_out_.data() + row0 * H,
        expert_gate_.data() + row0 * inter, expert_up_.data() + row0 * inter);
  };
  // Few rows per expert (decode): one pool dispatch for the whole layer, experts side by side.
  // Many rows (prefill): experts in turn, each matmul split across the pool.
  const int64_t pool = thread_pool().num_threads();
  if (pool > 1 && T * K <= 8 * pool && static_cast<int64_t>(active_experts_.size()) >= pool) {
    thread_pool().parallel_for(static_cast<int64_t>(active_experts_.size()), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) run_expert(active_experts_[i]);
    });
  } else {
    for (int32_t e : active_experts_) run_expert(e);
  }
  for (int64_t row = 0; row < T * K; ++row)
    ops_.add_scaled(out + routed_token_[row] * H, expert_out_.data() + row * H, routed_weight_[row], H);
}

double DeepseekModel::weight_bytes_per_step(int64_t tokens) const {
  const ModelConfig& c = config_;
  double expert_bytes = 0;  // one routed expert of every MoE layer
  int64_t moe_layers = 0;
  for (const LayerWeights& L : layers_)
    if (L.moe && !L.moe->experts.empty()) {
      const MlpWeights& e = L.moe->experts.front();
      expert_bytes += static_cast<double>(e.gate_proj.bytes() + e.up_proj.bytes() + e.down_proj.bytes());
      ++moe_layers;
    }
  const double always = static_cast<double>(active_weights_per_token().bytes) - expert_bytes * c.num_experts_per_tok;
  if (moe_layers == 0) return always;
  const double E = static_cast<double>(c.n_routed_experts), k = static_cast<double>(c.num_experts_per_tok);
  const double touched = E * (1.0 - std::pow(1.0 - k / E, static_cast<double>(tokens)));
  return always + expert_bytes * touched;
}

DeepseekModel::ActiveWeights DeepseekModel::active_weights_per_token() const {
  ActiveWeights a;
  auto add = [&a](const WeightMatrix& m, int64_t times = 1) {
    a.bytes += times * m.bytes();
    a.params += times * m.out_features * m.in_features;
  };
  a.bytes += embed_tokens_.in_features * static_cast<int64_t>(dtype_size(embed_tokens_.dtype));
  add(lm_head_);
  for (const LayerWeights& L : layers_) {
    const MlaWeights& A = L.attn;
    for (const auto& m : {A.q_a_proj, A.q_b_proj, A.q_proj})
      if (m) add(*m);
    add(A.kv_a_proj_with_mqa);
    add(A.o_proj);
    for (const auto& m : A.w_uk_t) add(m);
    for (const auto& m : A.w_uv) add(m);
    auto add_mlp = [&](const MlpWeights& m, int64_t times) {
      add(m.gate_proj, times);
      add(m.up_proj, times);
      add(m.down_proj, times);
    };
    if (L.dense_mlp) add_mlp(*L.dense_mlp, 1);
    if (L.moe) {
      add(L.moe->gate);
      if (L.moe->shared) add_mlp(*L.moe->shared, 1);
      if (!L.moe->experts.empty()) add_mlp(L.moe->experts.front(), config_.num_experts_per_tok);
    }
  }
  return a;
}

}  // namespace moat
