#include "models/deepseek_v3.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <span>
#include <tuple>

#include "base/log.h"
#include "loader/weight_map.h"
#include "models/op_needs.h"
#include "models/registry.h"

namespace moat {

int64_t DeepseekModel::kda_state_floats_per_layer() const {
  if (!config_.linear_attn) return 0;
  const LinearAttentionConfig& la = *config_.linear_attn;
  const int64_t width = kda_heads_ * la.head_dim;
  return 3 * (la.short_conv_kernel_size - 1) * width + kda_heads_ * la.head_dim * la.head_dim;
}

std::pair<int64_t, int64_t> expert_range_of_rank(int64_t experts, int tp, int rank) {
  return {experts * rank / tp, experts * (rank + 1) / tp};
}

Result<std::unique_ptr<DeepseekModel>> DeepseekModel::load(const std::filesystem::path& dir,
                                                           const Options& options) {
  std::unique_ptr<DeepseekModel> model(new DeepseekModel());
  model->options_ = options;
  MOAT_ASSIGN_OR_RETURN(model->config_, load_model_config(dir));
  if (options.mtp) {
    MOAT_ASSIGN_OR_RETURN(model->spec_, deepseek_v3_mtp_weight_spec(model->config_));
  } else {
    MOAT_ASSIGN_OR_RETURN(model->spec_, weight_spec_for(model->config_));
  }
  // A tensor-parallel rank faults in its own share only (load_weights), not the whole checkpoint.
  const bool tensor_parallel = options.comm && options.comm->size() > 1;
  MOAT_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(dir, options.weights, /*populate=*/!tensor_parallel));
  model->checkpoint_ = std::make_unique<Checkpoint>(std::move(checkpoint));
  MOAT_TRY(validate_checkpoint(*model->checkpoint_, model->spec_));
  model->comm_ = options.comm;
  if (model->comm_) {
    model->tp_ = model->comm_->size();
    model->tp_rank_ = model->comm_->rank();
  }
  const ModelConfig& c = model->config_;
  if (model->tp_ > 1 && options.mtp)
    return make_error("--tp {}: an MTP head runs on one rank (load it without a communicator)", model->tp_);
  MOAT_ASSIGN_OR_RETURN(ops::ModelOpNeeds needs, model_op_needs(c, model->tp_, options.kv_dtype));
  if (auto problems = tp_split_problems(model->spec_, model->tp_, options.expert_parallel); !problems.empty())
    return make_error("{}", problems.front());
  model->heads_ = needs.heads_per_rank;
  model->kda_heads_ = needs.kda_heads_per_rank;
  model->state_bytes_per_request_ =
      c.linear_attn ? c.num_kda_layers() * model->kda_state_floats_per_layer() * static_cast<int64_t>(sizeof(float)) : 0;
  model->expert_begin_ = 0;
  model->expert_end_ = c.n_routed_experts;
  if (options.expert_parallel && model->tp_ > 1) {  // tp_split_problems refused fewer experts than ranks
    std::tie(model->expert_begin_, model->expert_end_) =
        expert_range_of_rank(c.n_routed_experts, model->tp_, model->tp_rank_);
  }
  model->vocab_per_rank_ = (c.vocab_size + model->tp_ - 1) / model->tp_;
  MOAT_ASSIGN_OR_RETURN(model->ops_, ops::OpTable::resolve(options.backend, needs));
  if (options.max_context <= 0) return make_error("max context must be > 0, got {}", options.max_context);
  model->ops_.set_exact_activations(options.exact_activations);
  if (options.threads < 0) return make_error("threads must be >= 0 (0: hardware threads), got {}", options.threads);
  model->pool_ = shared_thread_pool(options.threads);
  model->rope_ = build_rope_table(model->config_, options.max_context);
  model->softmax_scale_ = static_cast<float>(model->config_.softmax_scale());
  MOAT_TRY(model->load_weights());
  model->tp_loaded_ = true;  // from here on the worker ranks wait for this model's steps
  return model;
}

Status DeepseekModel::load_weights() {
  const ModelConfig& c = config_;
  const Checkpoint& ck = *checkpoint_;
  layers_.assign(spec_.layers.size(), LayerWeights{});
  kda_layer_index_.assign(spec_.layers.size(), -1);
  int64_t mla_layers = 0, kda_layers = 0;
  for (const LayerSpec& ls : spec_.layers) {
    LayerWeights& L = layers_[ls.index];
    if (ls.attention == AttentionKind::kda) {
      L.kda.emplace();
      kda_layer_index_[ls.index] = kda_layers++;
    } else {
      L.cache_layer = mla_layers++;
    }
    if (ls.ffn == FfnKind::moe) {
      L.moe.emplace().experts.resize(static_cast<size_t>(spec_.routed_experts));
    } else {
      L.dense_mlp.emplace();
    }
  }
  num_mla_layers_ = mla_layers;
  bound_.assign(spec_.tensors.size(), nullptr);
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    const TensorSpec& t = spec_.tensors[i];
    if (t.is_matrix()) {
      WeightMatrix* slot = matrix_slot(t);
      MOAT_ASSIGN_OR_RETURN(*slot, get_matrix(ck, t.name, t.shape[0], t.shape[1], c,
                                              /*allow_fp8=*/t.storage == TensorStorage::matrix));
      MOAT_TRY(shard_matrix(t, *slot));
      bound_[i] = slot;
    } else {
      std::vector<float>& v = *vector_slot(t);
      MOAT_ASSIGN_OR_RETURN(v, get_vector_f32(ck, t.name, t.shape));
      if (tp_ > 1) {
        // Per-channel vectors (KDA convs, dt_bias) keep this rank's rows; A_log its heads' entries
        // (Kimi Linear's [1, 1, heads, 1] and K3's [K] whose first `heads` entries are used).
        if (t.split == TpSplit::column) {
          const int64_t rows = t.shape[0], per = rows / tp_, row_floats = t.numel() / rows;
          MOAT_CHECK(rows % (tp_ * t.split_unit) == 0, "{}: tp_split_problems let an uneven split through", t.name);
          v = std::vector<float>(v.begin() + per * tp_rank_ * row_floats, v.begin() + per * (tp_rank_ + 1) * row_floats);
        } else if (t.role == Role::kda_a_log) {
          v = std::vector<float>(v.begin() + kda_heads_ * tp_rank_, v.begin() + kda_heads_ * (tp_rank_ + 1));
        }
      }
    }
  }
  realign_matrices();
  if (c.tie_word_embeddings && !options_.mtp) {  // an MTP head has its own
    lm_head_ = embed_tokens_;
    if (tp_ > 1) {  // the embedding stays whole on every rank; the tied lm_head is cut by vocabulary
      const int64_t begin = vocab_per_rank_ * tp_rank_;
      MOAT_ASSIGN_OR_RETURN(lm_head_, slice_rows(lm_head_, begin, std::min(vocab_per_rank_, c.vocab_size - begin)));
    }
  }
  for (LayerWeights& L : layers_)
    if (!L.kda) absorb_kv_b(L.attn);
  // AttnRes scores a row by sum_d row[d] * norm[d] * proj[d] / rms(row): one product vector per site.
  auto product = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<float> p(a.size());
    for (size_t i = 0; i < a.size(); ++i) p[i] = a[i] * b[i];
    return p;
  };
  if (c.attn_res_block_size > 0) {
    for (LayerWeights& L : layers_) {
      L.res_attn_mix = product(L.res_attn_norm, L.res_attn_proj);
      L.res_mlp_mix = product(L.res_mlp_norm, L.res_mlp_proj);
    }
    res_output_mix_ = product(res_output_norm_, res_output_proj_);
  }
  return ok_status();
}

void DeepseekModel::realign_matrices() {
  const bool mapped = options_.weights == WeightPlacement::mmap;
  if (!options_.realign_weights || (mapped && !checkpoint_->fits_in_memory())) return;
  const bool tied = config_.tie_word_embeddings && !options_.mtp;
  std::vector<WeightMatrix*> matrices;
  for (const TensorSpec& t : spec_.tensors) {
    // The embedding is read a row per token, not streamed: it moves only when it is the lm_head too.
    if (!t.is_matrix() || (t.part == Part::embedding && !tied)) continue;
    matrices.push_back(matrix_slot(t));
  }
  // Mapped: drop this process's pages of each copied range (the page cache keeps them). Read into
  // memory: the copies are the few tensors the shifted image left off a line (SafetensorsFile), and
  // their bytes stay, as any other tensor could share their pages.
  auto release = [&](const void* p, size_t bytes) {
    if (mapped) Checkpoint::release_range(p, bytes);
  };
  realign_weights(matrices, realigned_, release);
}

std::vector<std::pair<const std::byte*, size_t>> DeepseekModel::weight_memory() const {
  std::vector<std::pair<const std::byte*, size_t>> ranges;
  auto add = [&](const void* p, int64_t bytes) {
    if (p != nullptr && bytes > 0) ranges.emplace_back(static_cast<const std::byte*>(p), static_cast<size_t>(bytes));
  };
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    const WeightMatrix* w = bound_[i];
    if (w == nullptr) continue;
    add(w->data, w->data_bytes());
    add(w->group_scales, w->group_scales_bytes());
    add(w->scale_inv, w->scale_inv_bytes());
  }
  std::sort(ranges.begin(), ranges.end());
  // Ranges in one checkpoint file merge across the gaps between them (the file is mapped or read
  // whole, so the gaps are readable); elsewhere only touching ones do.
  auto file_of = [&](const std::byte* p) -> int64_t {
    for (size_t f = 0; f < checkpoint_->files().size(); ++f) {
      const SafetensorsFile& file = *checkpoint_->files()[f];
      if (p >= file.mapping() && p < file.mapping() + file.file_size()) return static_cast<int64_t>(f);
    }
    return -1;
  };
  std::vector<std::pair<const std::byte*, size_t>> merged;
  int64_t merged_file = -1;  // the file merged.back() lies in, -1 for none
  for (const auto& [p, n] : ranges) {
    const int64_t file = file_of(p);
    const bool joins = !merged.empty() && (p <= merged.back().first + merged.back().second ||
                                           (file >= 0 && file == merged_file));
    if (joins) {
      const std::byte* end = std::max(merged.back().first + merged.back().second, p + n);
      merged.back().second = static_cast<size_t>(end - merged.back().first);
    } else {
      merged.emplace_back(p, n);
      merged_file = file;
    }
  }
  return merged;
}

const WeightMatrix* DeepseekModel::weight_matrix(std::string_view name) const {
  for (size_t i = 0; i < spec_.tensors.size(); ++i)
    if (spec_.tensors[i].name == name) return bound_[i];
  return nullptr;
}

MappingPageStats DeepseekModel::weight_page_stats() const {
  MappingPageStats total = checkpoint_->page_stats();
  const MappingPageStats copies = mapping_page_stats(realigned_.data());
  total.resident += copies.resident;
  total.huge += copies.huge;
  return total;
}

namespace {

WeightMatrix* mlp_slot(MlpWeights& m, Role role) {
  switch (role) {
    case Role::gate_proj: return &m.gate_proj;
    case Role::up_proj: return &m.up_proj;
    case Role::down_proj: return &m.down_proj;
    default: return nullptr;
  }
}

template <typename T>
T& created(std::optional<T>& part) {
  return part ? *part : part.emplace();
}

}  // namespace

Status DeepseekModel::shard_matrix(const TensorSpec& t, WeightMatrix& m) {
  if (tp_ == 1) return ok_status();
  TpSplit split = t.split;
  // Mapped weights: fault in what this rank reads (the checkpoint was opened without populating),
  // and drop its mapping of what it copied out (a column slice touched every page of the whole).
  const bool mapped = options_.weights == WeightPlacement::mmap;
  auto advise = [&](const WeightMatrix& w, bool populate) {
    if (!mapped) return;
    auto range = [&](const void* p, size_t n) {
      if (populate) Checkpoint::populate_range(p, n); else Checkpoint::release_range(p, n);
    };
    range(w.data, static_cast<size_t>(w.data_bytes()));
    if (w.is_4bit()) range(w.group_scales, static_cast<size_t>(w.group_scales_bytes()));
  };
  auto named = [&](Result<WeightMatrix> r) -> Status {
    if (!r.ok()) return make_error("{} at --tp {}: {}", t.name, tp_, r.error().message);
    const bool copied = split == TpSplit::row;
    if (copied) advise(m, /*populate=*/false);
    m = *r;
    if (!copied) advise(m, /*populate=*/true);
    return ok_status();
  };
  // EP: an expert stays whole (only its owner reads it: the others' views of it are never
  // touched, so its pages are never read). TP: split inside each expert, as a dense MLP.
  if (split == TpSplit::expert && options_.expert_parallel) {
    if (t.expert >= expert_begin_ && t.expert < expert_end_) advise(m, /*populate=*/true);
    return ok_status();
  }
  if (split == TpSplit::expert) split = t.role == Role::down_proj ? TpSplit::row : TpSplit::column;
  switch (split) {
    case TpSplit::replicated:
      advise(m, /*populate=*/true);
      return ok_status();
    case TpSplit::column:
    case TpSplit::row: {
      const int64_t n = split == TpSplit::column ? m.out_features : m.in_features;
      MOAT_CHECK(n % (tp_ * t.split_unit) == 0, "{}: tp_split_problems let an uneven split through", t.name);
      const int64_t per = n / tp_;
      if (split == TpSplit::column) return named(slice_rows(m, per * tp_rank_, per));
      return named(copy_columns(m, per * tp_rank_, per, owned_.emplace_back()));
    }
    case TpSplit::vocab: {
      if (t.part == Part::embedding) return ok_status();  // a lookup reads one row per token: keep it whole
      const int64_t begin = vocab_per_rank_ * tp_rank_;
      return named(slice_rows(m, begin, std::min(vocab_per_rank_, m.out_features - begin)));
    }
    case TpSplit::expert: break;
  }
  return make_error("{}: no tensor-parallel split for it", t.name);
}

DeepseekModel::~DeepseekModel() {
  // Only a model that loaded has workers waiting for it: every rank fails a load alike.
  if (tp_ > 1 && tp_rank_ == 0 && tp_loaded_) send_tp_step(1, nullptr, nullptr);
}

WeightMatrix* DeepseekModel::matrix_slot(const TensorSpec& t) {
  WeightMatrix* slot = nullptr;
  LayerWeights* L = t.layer >= 0 ? &layers_.at(static_cast<size_t>(t.layer)) : nullptr;
  switch (t.part) {
    case Part::embedding: slot = &embed_tokens_; break;
    case Part::lm_head: slot = &lm_head_; break;
    case Part::attention: {
      if (L->kda) {
        KdaWeights& K = *L->kda;
        switch (t.role) {
          case Role::kda_q_proj: slot = &K.q_proj; break;
          case Role::kda_k_proj: slot = &K.k_proj; break;
          case Role::kda_v_proj: slot = &K.v_proj; break;
          case Role::kda_f_a_proj: slot = &K.f_a_proj; break;
          case Role::kda_f_b_proj: slot = &K.f_b_proj; break;
          case Role::kda_b_proj: slot = &K.b_proj; break;
          case Role::kda_g_a_proj: slot = &K.g_a_proj; break;
          case Role::kda_g_b_proj: slot = &K.g_b_proj; break;
          case Role::kda_g_proj: slot = &created(K.g_proj); break;
          case Role::o_proj: slot = &K.o_proj; break;
          default: break;
        }
        break;
      }
      MlaWeights& A = L->attn;
      switch (t.role) {
        case Role::q_a_proj: slot = &created(A.q_a_proj); break;
        case Role::q_b_proj: slot = &created(A.q_b_proj); break;
        case Role::q_proj: slot = &created(A.q_proj); break;
        case Role::kv_a_proj: slot = &A.kv_a_proj_with_mqa; break;
        case Role::kv_b_proj: slot = &A.kv_b_proj; break;
        case Role::o_proj: slot = &A.o_proj; break;
        case Role::attn_output_gate: slot = &created(A.output_gate); break;
        default: break;
      }
      break;
    }
    case Part::dense_mlp:
      if (L->dense_mlp) slot = mlp_slot(*L->dense_mlp, t.role);
      break;
    case Part::router:
      if (L->moe && t.role == Role::weight) slot = &L->moe->gate;
      break;
    case Part::routed_expert:
      if (L->moe && t.expert >= 0 && t.expert < static_cast<int64_t>(L->moe->experts.size()))
        slot = mlp_slot(L->moe->experts[static_cast<size_t>(t.expert)], t.role);
      break;
    case Part::mtp_input:
      if (t.role == Role::mtp_eh_proj) slot = &mtp_eh_proj_;
      break;
    case Part::shared_experts:
      if (L->moe) slot = mlp_slot(created(L->moe->shared), t.role);
      break;
    case Part::latent_moe:
      if (L->moe && t.role == Role::latent_down_proj) slot = &created(L->moe->latent_down);
      if (L->moe && t.role == Role::latent_up_proj) slot = &created(L->moe->latent_up);
      break;
    default: break;
  }
  MOAT_CHECK(slot, "{}: the weight spec lists a matrix this model has no place for", t.name);
  return slot;
}

std::vector<float>* DeepseekModel::vector_slot(const TensorSpec& t) {
  std::vector<float>* slot = nullptr;
  LayerWeights* L = t.layer >= 0 ? &layers_.at(static_cast<size_t>(t.layer)) : nullptr;
  switch (t.role) {
    case Role::weight:
      if (t.part == Part::final_norm) slot = &final_norm_;
      break;
    case Role::input_norm: slot = &L->input_layernorm; break;
    case Role::post_attention_norm: slot = &L->post_attention_layernorm; break;
    case Role::q_a_norm: slot = &L->attn.q_a_layernorm; break;
    case Role::kv_a_norm: slot = &L->attn.kv_a_layernorm; break;
    case Role::mtp_enorm: slot = &mtp_enorm_; break;
    case Role::mtp_hnorm: slot = &mtp_hnorm_; break;
    case Role::score_bias:
      if (L->moe) slot = &L->moe->score_bias;
      break;
    case Role::kda_q_conv: if (L->kda) slot = &L->kda->q_conv; break;
    case Role::kda_k_conv: if (L->kda) slot = &L->kda->k_conv; break;
    case Role::kda_v_conv: if (L->kda) slot = &L->kda->v_conv; break;
    case Role::kda_a_log: if (L->kda) slot = &L->kda->a_log; break;
    case Role::kda_dt_bias: if (L->kda) slot = &L->kda->dt_bias; break;
    case Role::kda_o_norm: if (L->kda) slot = &L->kda->o_norm; break;
    case Role::latent_norm: if (L->moe) slot = &L->moe->latent_norm; break;
    case Role::res_attn_norm: slot = &L->res_attn_norm; break;
    case Role::res_attn_proj: slot = &L->res_attn_proj; break;
    case Role::res_mlp_norm: slot = &L->res_mlp_norm; break;
    case Role::res_mlp_proj: slot = &L->res_mlp_proj; break;
    case Role::res_output_norm: slot = &res_output_norm_; break;
    case Role::res_output_proj: slot = &res_output_proj_; break;
    default: break;
  }
  MOAT_CHECK(slot, "{}: the weight spec lists a vector this model has no place for", t.name);
  return slot;
}

void DeepseekModel::absorb_kv_b(MlaWeights& A) {
  const ModelConfig& c = config_;
  const int64_t heads = heads_, nope = c.qk_nope_head_dim, vdim = c.v_head_dim;
  const int64_t kv_lora = c.kv_lora_rank;
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
  grow(mlp_gate_, T * inter);
  grow(mlp_up_, T * inter);
  grow(router_logits_, T * std::max<int64_t>(1, c.n_routed_experts));
  if (c.attn_res_block_size > 0) {
    const int64_t rows = (c.num_hidden_layers + c.attn_res_block_size - 1) / c.attn_res_block_size;
    grow(res_bank_, rows * T * H);
    grow(res_mixed_, T * H);
  }
  if (c.routed_expert_hidden_size > 0) {
    grow(latent_z_, T * c.routed_expert_hidden_size);
    grow(latent_sum_, T * c.routed_expert_hidden_size);
    grow(latent_up_, T * H);
  }
  if (c.mla_use_output_gate) grow(attn_gate_, T * heads * c.v_head_dim);
  grow(logits_in_, T * H);
  if (options_.mtp) grow(mtp_cat_, T * 2 * H);
  if (c.linear_attn) {
    const int64_t width = c.linear_attn->num_heads * c.linear_attn->head_dim;
    for (Buffer* b : {&kda_q_, &kda_k_, &kda_v_, &kda_g_, &kda_out_, &kda_gate_out_}) grow(*b, T * width);
    // q / k / v projections: side by side in decode-sized calls (kda_attention's matmul group)
    grow(kda_proj_, std::max(T, 3 * std::min(T, kKdaGroupMaxTokens)) * width);
    grow(kda_low_, T * c.linear_attn->head_dim);
    grow(kda_gate_low_, T * c.linear_attn->head_dim);
    grow(kda_beta_, T * c.linear_attn->num_heads);
  }
  topk_ids_.resize(static_cast<size_t>(T * std::max<int64_t>(1, c.num_experts_per_tok)));
  topk_weights_.resize(topk_ids_.size());
  kv_lens_.resize(static_cast<size_t>(T));
  reserved_tokens_ = T;
}

void DeepseekModel::forward(const ForwardBatch& batch, PagedLatentCache& cache, float* logits,
                            const LayerHook& on_layer_output, const ForwardExtras& extras) {
  if (tp_ > 1) {
    MOAT_CHECK(tp_rank_ == 0, "rank {}: tensor-parallel worker ranks run rank 0's steps in run_tp_worker()", tp_rank_);
    send_tp_step(0, &batch, &cache, &extras);
  }
  forward_local(batch, cache, logits, on_layer_output, extras);
}

void DeepseekModel::forward_local(const ForwardBatch& batch, PagedLatentCache& cache, float* logits,
                                  const LayerHook& on_layer_output, const ForwardExtras& extras) {
  const ModelConfig& c = config_;
  const int64_t T = batch.num_tokens();
  MOAT_CHECK(batch.positions.size() == batch.tokens.size() && batch.slot_mapping.size() == batch.tokens.size() &&
                 batch.token_seq.size() == batch.tokens.size(),
             "batch arrays disagree in length");
  MOAT_CHECK(batch.block_size == cache.block_size(), "batch block size {} but the cache's is {}", batch.block_size,
             cache.block_size());
  MOAT_CHECK(cache.shape().num_layers == num_mla_layers_ && cache.shape().dim == c.kv_cache_dim(),
             "cache shaped for {} layers x {} values, model has {} x {}", cache.shape().num_layers,
             cache.shape().dim, num_mla_layers_, c.kv_cache_dim());
  if (state_bytes_per_request() > 0) {
    MOAT_CHECK(extras.states != nullptr && extras.states->bytes_per_slot() == state_bytes_per_request(),
               "this model keeps {} bytes of recurrent state per request: pass its StateSlotPool", state_bytes_per_request());
    MOAT_CHECK(static_cast<int32_t>(batch.state_slots.size()) == batch.num_sequences(), "{} state slots for {} sequences",
               batch.state_slots.size(), batch.num_sequences());
    for (int32_t slot : batch.state_slots)
      MOAT_CHECK(slot >= 0 && slot < extras.states->num_slots() && extras.states->in_use(slot),
                 "sequence without a state slot in use (slot {})", slot);
  }
  MOAT_CHECK(cache.shape().dtype == options_.kv_dtype, "cache dtype {} but ops resolved for {}",
             dtype_name(cache.shape().dtype), dtype_name(options_.kv_dtype));
  const int64_t slots = static_cast<int64_t>(cache.num_blocks()) * cache.block_size();
  for (int64_t t = 0; t < T; ++t) {
    MOAT_CHECK(batch.positions[t] >= 0 && batch.positions[t] < options_.max_context,
               "position {} outside max context {}", batch.positions[t], options_.max_context);
    MOAT_CHECK(batch.slot_mapping[t] >= 0 && batch.slot_mapping[t] < slots, "slot {} outside the cache's {}",
               batch.slot_mapping[t], slots);
  }
  // Speculative verification of a hybrid model: room for the state after every token of each
  // short sequence (rewind_state copies one of them back).
  const int32_t S = batch.num_sequences();
  kda_step_base_.assign(static_cast<size_t>(S), -1);
  kda_step_len_.assign(static_cast<size_t>(S), 0);
  if (extras.keep_step_states && state_bytes_per_request() > 0) {
    const int64_t per_token = c.num_kda_layers() * kda_state_floats_per_layer();
    int64_t total = 0;
    for (int32_t s = 0; s < S; ++s) {
      const int32_t len = batch.query_start[s + 1] - batch.query_start[s];
      if (len <= 0 || len > kMaxStepTokens) continue;
      kda_step_base_[s] = total;
      kda_step_len_[s] = len;
      total += len * per_token;
    }
    if (static_cast<int64_t>(kda_steps_.size()) < total) kda_steps_.resize(static_cast<size_t>(total));
  }
  // Every kernel of this step splits over this model's pool, whatever another model in the
  // process uses.
  ScopedThreadPool pool_scope(*pool_);
  reserve(T);
  const int64_t H = c.hidden_size;
  float* x = x_.data();  // residual stream [T, hidden]
  float* h = h_.data();  // normed input of the current sublayer [T, hidden]
  const float eps = static_cast<float>(c.rms_norm_eps);
  ops_.embedding(embed_tokens_, batch.tokens.data(), T, x);
  if (options_.mtp) {
    // x = eh_proj([enorm(embedding of the next token); hnorm(main model's h)]); the embedding is
    // zeroed at position 0, as vLLM runs DeepSeek's MTP
    MOAT_CHECK(extras.mtp_prev_hidden != nullptr, "an MTP head needs the main model's hidden states");
    float* cat = mtp_cat_.data();
    for (int64_t t = 0; t < T; ++t)
      if (batch.positions[t] == 0) std::fill(x + t * H, x + (t + 1) * H, 0.0f);
    ops_.rms_norm(x, mtp_enorm_.data(), T, H, eps, h);
    ops_.rms_norm(extras.mtp_prev_hidden, mtp_hnorm_.data(), T, H, eps, tmp_.data());
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(cat + t * 2 * H, h + t * H, sizeof(float) * H);
      std::memcpy(cat + t * 2 * H + H, tmp_.data() + t * H, sizeof(float) * H);
    }
    ops_.matmul(cat, T, mtp_eh_proj_, x);
  }

  // Kimi K3's attention residuals: x is the running sum P of the current block; each sublayer
  // reads a softmax-weighted mix of the bank of earlier blocks' sums and P, and every
  // attn_res_block_size layers P joins the bank and restarts at 0. Without AttnRes the mix is x.
  const int64_t block = c.attn_res_block_size;
  std::vector<const float*> rows;  // the bank's rows, then P
  auto mixed = [&](const std::vector<float>& weight) -> const float* {
    if (block == 0) return x;
    rows.push_back(x);
    attn_res_mix(rows.data(), static_cast<int64_t>(rows.size()), T, weight, res_mixed_.data());
    rows.pop_back();
    return res_mixed_.data();
  };
  for (int64_t i = 0; i < num_layers(); ++i) {
    const LayerWeights& L = layers_[i];
    ops_.rms_norm(mixed(L.res_attn_mix), L.input_layernorm.data(), T, H, eps, h);
    if (block > 0 && i % block == 0) {
      float* row = res_bank_.data() + static_cast<int64_t>(rows.size()) * T * H;
      std::memcpy(row, x, sizeof(float) * T * H);
      rows.push_back(row);
      std::fill(x, x + T * H, 0.0f);
    }
    if (L.kda) {
      kda_attention(*L.kda, kda_layer_index_[i], batch, *extras.states, h, tmp_.data());
    } else {
      attention(L, batch, cache, h, tmp_.data());
    }
    all_reduce(tmp_.data(), T * H);  // each rank's heads' share of o_proj
    ops_.add_scaled(x, tmp_.data(), 1.0f, T * H);
    ops_.rms_norm(mixed(L.res_mlp_mix), L.post_attention_layernorm.data(), T, H, eps, h);
    if (L.moe) {
      moe(*L.moe, h, T, tmp_.data());
    } else {
      mlp(*L.dense_mlp, h, T, tmp_.data(), mlp_gate_.data(), mlp_up_.data());
    }
    all_reduce(tmp_.data(), T * H);  // each rank's slice of the intermediate width
    ops_.add_scaled(x, tmp_.data(), 1.0f, T * H);
    if (on_layer_output) on_layer_output(i, x, T);
  }
  // What the final norm reads: the output mix under AttnRes, else the residual stream.
  const float* final_in = mixed(res_output_mix_);

  if (extras.residual) std::memcpy(extras.residual, final_in, sizeof(float) * T * H);
  if (extras.final_hidden) ops_.rms_norm(final_in, final_norm_.data(), T, H, eps, extras.final_hidden);

  // Only the rows that need logits go through the final norm and lm_head.
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  if (R == 0) return;  // a prompt chunk that samples nothing (logits may be null)
  for (int64_t r = 0; r < R; ++r) {
    const int32_t row = batch.logit_rows[r];
    MOAT_CHECK(row >= 0 && row < T, "logit row {} outside batch of {}", row, T);
    std::memcpy(logits_in_.data() + r * H, final_in + row * H, sizeof(float) * H);
  }
  ops_.rms_norm(logits_in_.data(), final_norm_.data(), R, H, static_cast<float>(c.rms_norm_eps), logits_in_.data());
  if (tp_ == 1) {
    ops_.matmul(logits_in_.data(), R, lm_head_, logits);
    return;
  }
  // Vocabulary-parallel lm_head: each rank's rows [R, vocab_per_rank] (the last rank's padded with
  // zeros), gathered, and laid out as [R, vocab] on rank 0.
  const int64_t Vr = vocab_per_rank_, V = c.vocab_size;
  logits_local_.resize(static_cast<size_t>(R * Vr));
  logits_gathered_.resize(static_cast<size_t>(tp_ * R * Vr));
  const int64_t head_rows = lm_head_.out_features;
  if (head_rows == Vr) {
    ops_.matmul(logits_in_.data(), R, lm_head_, logits_local_.data());
  } else {
    ops_.matmul(logits_in_.data(), R, lm_head_, logits_gathered_.data());  // [R, head_rows] scratch
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(logits_local_.data() + r * Vr, logits_gathered_.data() + r * head_rows, sizeof(float) * head_rows);
      std::fill(logits_local_.data() + r * Vr + head_rows, logits_local_.data() + (r + 1) * Vr, 0.0f);
    }
  }
  comm_->all_gather(logits_local_.data(), R * Vr, logits_gathered_.data());
  if (logits == nullptr) return;  // a worker rank: rank 0 samples
  for (int64_t k = 0; k < tp_; ++k) {
    const int64_t begin = k * Vr, n = std::min(Vr, V - begin);
    for (int64_t r = 0; r < R && n > 0; ++r)
      std::memcpy(logits + r * V + begin, logits_gathered_.data() + (k * R + r) * Vr, sizeof(float) * n);
  }
}

void DeepseekModel::attention(const LayerWeights& layer, const ForwardBatch& batch, PagedLatentCache& cache,
                              const float* x, float* out) {
  const ModelConfig& c = config_;
  const MlaWeights& A = layer.attn;
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t heads = heads_, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;  // this rank's heads
  const int64_t qk = nope + rope, kv_lora = c.kv_lora_rank, D = kv_lora + rope, vdim = c.v_head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // The projections of x, as one matmul group: q ([T, q_lora] low rank, or [T, heads, nope + rope]),
  // kv ([T, kv_lora + rope]) and K3's output gate ([T, heads * v]).
  float* q = q_.data();
  float* kv = kv_.data();
  std::array<ops::MatmulOut, 3> projections{
      {{A.q_a_proj ? &*A.q_a_proj : &*A.q_proj, A.q_a_proj ? q_lora_.data() : q}, {&A.kv_a_proj_with_mqa, kv}}};
  if (A.output_gate) projections[2] = {&*A.output_gate, attn_gate_.data()};
  ops_.matmul_group(x, T, projections.data(), A.output_gate ? 3 : 2);
  if (A.q_a_proj) {
    const int64_t ql = *c.q_lora_rank;
    ops_.rms_norm(q_lora_.data(), A.q_a_layernorm.data(), T, ql, eps, q_lora_.data());
    ops_.matmul(q_lora_.data(), T, *A.q_b_proj, q);  // [T, heads, nope + rope]
  }
  // kv -> the cache rows of this layer: normed latent, roped k_pe
  if (!c.mla_use_nope) {  // Kimi Linear's MLA uses the rope-width slices unrotated
    ops_.rope({kv + kv_lora, T, 1, D, D, rope, batch.positions.data(), rope_.cos.data(), rope_.sin.data()});
    ops_.rope({q + nope, T, heads, heads * qk, qk, rope, batch.positions.data(), rope_.cos.data(), rope_.sin.data()});
  }
  // kv becomes the cache rows [T, D] in place: normed latent, then the roped k_pe.
  for (int64_t t = 0; t < T; ++t) {
    ops_.rms_norm(kv + t * D, A.kv_a_layernorm.data(), 1, kv_lora, eps, kv + t * D);
    kv_lens_[t] = batch.positions[t] + 1;
  }
  const ops::LatentPages pages = cache.layer(layer.cache_layer);
  ops_.store_latent({kv, T, D, batch.slot_mapping.data(), pages});

  // Absorb W_UK: q_full[t, h] = [q_nope[t, h] . W_UK_h^T (kv_lora) | q_pe[t, h] (rope)]  [T, heads, D]
  float* q_full = q_full_.data();
  ops_.head_matmul({.x = q, .x_token_stride = heads * qk, .x_head_stride = qk, .num_tokens = T, .num_heads = heads,
                    .weights = A.w_uk_t.data(), .y = q_full, .y_token_stride = heads * D, .y_head_stride = D,
                    .pass = rope});

  ops::MlaAttentionArgs args{q_full, T, heads, kv_lora, rope, pages, batch.block_tables.data(), batch.max_blocks,
                             batch.token_seq.data(), kv_lens_.data(), softmax_scale_, attn_latent_.data()};
  ops_.mla_attention(args);  // [T, heads, kv_lora]

  // Expand through W_UV: attn_v[t, h] = latent[t, h] . W_UV_h^T  [T, heads, v]
  ops_.head_matmul({.x = attn_latent_.data(), .x_token_stride = heads * kv_lora, .x_head_stride = kv_lora,
                    .num_tokens = T, .num_heads = heads, .weights = A.w_uv.data(), .y = attn_v_.data(),
                    .y_token_stride = heads * vdim, .y_head_stride = vdim});
  if (A.output_gate) {  // K3: attn_v * sigmoid(g_proj(x)), per element (g_proj(x) from the group above)
    ops_.sigmoid_mul(attn_v_.data(), attn_gate_.data(), T * heads * vdim, attn_v_.data());
  }
  ops_.matmul(attn_v_.data(), T, A.o_proj, out);  // [T, hidden]
}

void DeepseekModel::mlp(const MlpWeights& w, const float* x, int64_t T, float* out, float* gate, float* up) {
  const int64_t n = w.gate_proj.out_features;
  ops_.matmul_group(x, T, {{&w.gate_proj, gate}, {&w.up_proj, up}});  // [T, n] each
  gated_activation(gate, up, T, n);
  ops_.matmul(gate, T, w.down_proj, out);  // [T, hidden]
}

void DeepseekModel::gated_activation(float* gate, const float* up, int64_t T, int64_t n) {
  if (config_.hidden_act == "situ") {
    ops_.situ_mul(gate, up, T, n, static_cast<float>(config_.situ_beta), static_cast<float>(config_.situ_linear_beta),
                  gate);
  } else {
    ops_.silu_mul(gate, up, T, n, gate);
  }
}

void DeepseekModel::attn_res_mix(const float* const* rows, int64_t num_rows, int64_t T, const std::vector<float>& weight,
                                 float* out) {
  ops_.attn_res_mix({.rows = rows, .num_rows = num_rows, .num_tokens = T, .dim = config_.hidden_size,
                     .weight = weight.data(), .eps = static_cast<float>(config_.rms_norm_eps), .out = out});
}

void DeepseekModel::moe(const MoeWeights& w, const float* x, int64_t T, float* out) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
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
  if (expert_end_ - expert_begin_ < E) {  // EP: the other ranks' experts are theirs to run
    for (int32_t& id : std::span(topk_ids_.data(), static_cast<size_t>(T * K)))
      if (id < expert_begin_ || id >= expert_end_) id = -1;
  }

  // Shared experts see every token, unscaled.
  if (w.shared) {
    mlp(*w.shared, x, T, out, mlp_gate_.data(), mlp_up_.data());
  } else {
    std::fill(out, out + T * H, 0.0f);
  }

  const ops::GatedActivation act = c.hidden_act == "situ" ? ops::GatedActivation::situ : ops::GatedActivation::silu;
  if (!w.latent_down) {
    // Routed experts, weighted, added onto the shared experts' output.
    ops_.moe_experts({.x = x, .num_tokens = T, .hidden = H, .top_k = K, .topk_ids = topk_ids_.data(),
                      .topk_weights = topk_weights_.data(), .experts = w.experts.data(), .num_experts = E,
                      .intermediate = w.experts[0].gate_proj.out_features, .out = out, .activation = act,
                      .situ_beta = static_cast<float>(c.situ_beta), .situ_linear_beta = static_cast<float>(c.situ_linear_beta)});
    return;
  }
  // K3's latent MoE: the experts' weighted sum is formed in the latent space [T, R], normed, and
  // projected back onto the shared experts' output.
  const int64_t R = c.routed_expert_hidden_size;
  ops_.matmul(x, T, *w.latent_down, latent_z_.data());
  std::fill(latent_sum_.data(), latent_sum_.data() + T * R, 0.0f);
  ops_.moe_experts({.x = latent_z_.data(), .num_tokens = T, .hidden = R, .top_k = K, .topk_ids = topk_ids_.data(),
                    .topk_weights = topk_weights_.data(), .experts = w.experts.data(), .num_experts = E,
                    .intermediate = w.experts[0].gate_proj.out_features, .out = latent_sum_.data(), .activation = act,
                    .situ_beta = static_cast<float>(c.situ_beta), .situ_linear_beta = static_cast<float>(c.situ_linear_beta)});
  all_reduce(latent_sum_.data(), T * R);  // the norm needs the whole sum; latent_up is replicated
  if (!w.latent_norm.empty())
    ops_.rms_norm(latent_sum_.data(), w.latent_norm.data(), T, R, static_cast<float>(c.rms_norm_eps), latent_sum_.data());
  if (tp_rank_ != 0) return;  // every rank has it whole: rank 0 alone adds it before the layer's all-reduce
  ops_.matmul(latent_sum_.data(), T, *w.latent_up, latent_up_.data());
  ops_.add_scaled(out, latent_up_.data(), 1.0f, T * H);
}

int64_t DeepseekModel::weight_bytes_on_rank() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    const TensorSpec& t = spec_.tensors[i];
    if (t.part == Part::routed_expert && (t.expert < expert_begin_ || t.expert >= expert_end_)) continue;
    if (t.is_matrix()) {
      bytes += bound_[i]->bytes();
    } else {
      bytes += 2 * (t.split == TpSplit::column ? t.numel() / tp_ : t.numel());
    }
  }
  return bytes;
}

double DeepseekModel::weight_bytes_per_step(int64_t tokens) const {
  const ModelConfig& c = config_;
  double expert_bytes = 0;  // one routed expert (the first) of every MoE layer
  int64_t moe_layers = 0;
  for (const LayerSpec& ls : spec_.layers) moe_layers += ls.ffn == FfnKind::moe && spec_.routed_experts > 0;
  for (size_t i = 0; i < spec_.tensors.size(); ++i)
    if (spec_.tensors[i].part == Part::routed_expert && spec_.tensors[i].expert == 0)
      expert_bytes += static_cast<double>(bound_[i]->bytes());
  const double always = static_cast<double>(active_weights_per_token().bytes) - expert_bytes * c.num_experts_per_tok;
  if (moe_layers == 0) return always;
  const double E = static_cast<double>(c.n_routed_experts), k = static_cast<double>(c.num_experts_per_tok);
  const double touched = E * (1.0 - std::pow(1.0 - k / E, static_cast<double>(tokens)));
  return always + expert_bytes * touched;
}

DeepseekModel::ActiveWeights DeepseekModel::active_weights_per_token() const {
  ActiveWeights a;
  auto add = [&a](const WeightMatrix& m) {
    a.bytes += m.bytes();
    a.params += m.out_features * m.in_features;
  };
  // Matrices only (norms and biases are noise next to them), as the model streams them: one
  // embedding row, the tied table again as lm_head, kv_b_proj as its absorbed per-head copies.
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    const TensorSpec& t = spec_.tensors[i];
    if (!t.is_matrix() || !spec_.read_per_token(t)) continue;
    const WeightMatrix& m = *bound_[i];
    if (t.part == Part::embedding) {
      a.bytes += m.in_features * static_cast<int64_t>(dtype_size(m.dtype));
      if (config_.tie_word_embeddings && !options_.mtp) add(lm_head_);
    } else if (t.role == Role::kv_b_proj) {
      const MlaWeights& A = layers_[static_cast<size_t>(t.layer)].attn;
      for (const auto& w : A.w_uk_t) add(w);
      for (const auto& w : A.w_uv) add(w);
    } else {
      add(m);
    }
  }
  return a;
}

}  // namespace moat
