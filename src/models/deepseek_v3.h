// DeepSeek-V3 architecture (also DeepSeek-V2/V2-Lite and Kimi K2): MLA attention with the absorbed
// decode form over a latent cache, dense MLP for the first layers, MoE with group-limited routing
// and shared experts. Kimi Linear runs here too: its layers are MLA (without RoPE) or Kimi Delta
// Attention, a gated linear-attention recurrence whose fixed-size state per request lives in a
// StateSlotPool slot (kv/state_pool.h) instead of the paged cache, which holds MLA layers only. Weights stay in the mmapped checkpoint; activations live in a Workspace
// that grows with the largest batch and is then reused (no allocation in the token loop).
#pragma once

#include <array>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "base/huge_pages.h"
#include "base/tensor.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "config/model_config.h"
#include "dist/communicator.h"
#include "kv/latent_cache.h"
#include "kv/state_pool.h"
#include "models/forward_batch.h"
#include "loader/checkpoint.h"
#include "models/rope.h"
#include "models/weight_spec.h"
#include "ops/dispatch.h"

namespace moat {

struct MlaWeights {
  std::optional<WeightMatrix> q_a_proj;  // [q_lora, hidden] when q_lora_rank is set
  std::vector<float> q_a_layernorm;      // [q_lora]
  std::optional<WeightMatrix> q_b_proj;  // [heads * (nope + rope), q_lora]
  std::optional<WeightMatrix> q_proj;    // [heads * (nope + rope), hidden] when q_lora_rank is null
  WeightMatrix kv_a_proj_with_mqa;       // [kv_lora + rope, hidden]
  std::vector<float> kv_a_layernorm;     // [kv_lora]
  WeightMatrix kv_b_proj;                // [heads * (nope + v), kv_lora]: per head W_UK then W_UV
  WeightMatrix o_proj;                   // [hidden, heads * v]
  std::optional<WeightMatrix> output_gate;  // K3 g_proj [heads * v, hidden]: out * sigmoid(g_proj(x))
  // W_UK transposed per head, so absorbing q_nope into latent space is a plain matmul:
  // [heads][kv_lora, nope]. The one weight moat copies: bf16 when kv_b is bf16 (exact) or fp8
  // without exact activations (W8A16: one more rounding of the dequantized value, 2^-9), else fp32.
  // In huge pages, as the checkpoint's mapped weights (HugePageAllocator).
  HugePageVector<uint16_t> w_uk_t_bf16;
  HugePageVector<float> w_uk_t_f32;
  std::vector<WeightMatrix> w_uk_t;      // [heads] views of the above
  // fp8 checkpoints only: dequantized [heads][v, kv_lora], in the dtype of w_uk_t
  HugePageVector<uint16_t> w_uv_bf16;
  HugePageVector<float> w_uv_f32;
  std::vector<WeightMatrix> w_uv;        // [heads] [v, kv_lora]: row slices of kv_b_proj, or views of the above
};

struct MoeWeights {
  WeightMatrix gate;                     // router [n_routed, hidden]
  std::vector<float> score_bias;         // e_score_correction_bias [n_routed] (noaux_tc)
  std::vector<MlpWeights> experts;       // [n_routed]
  std::optional<MlpWeights> shared;      // width n_shared * moe_intermediate
  // K3's latent MoE: routed experts work on z = latent_down(x) [latent]; their weighted sum is
  // normed and brought back by latent_up [hidden, latent]. Experts' hidden width is then latent.
  std::optional<WeightMatrix> latent_down, latent_up;
  std::vector<float> latent_norm;        // [latent] when latent_moe_use_norm
};

// Kimi Delta Attention (Kimi Linear). width = heads * K, K = head_dim (= V).
struct KdaWeights {
  WeightMatrix q_proj, k_proj, v_proj;           // [width, hidden]
  std::vector<float> q_conv, k_conv, v_conv;     // [width, conv]: depthwise causal conv weights
  WeightMatrix f_a_proj, f_b_proj;               // [K, hidden], [width, K]: decay gate (low rank)
  std::vector<float> a_log;                      // [heads]
  std::vector<float> dt_bias;                    // [width]
  WeightMatrix b_proj;                           // [heads, hidden]: beta logits
  WeightMatrix g_a_proj, g_b_proj;               // [K, hidden], [width, K]: output gate (low rank)
  std::optional<WeightMatrix> g_proj;            // [width, hidden]: K3's full-rank output gate
  std::vector<float> o_norm;                     // [K]
  WeightMatrix o_proj;                           // [hidden, width]
};

// One group of a KDA layer's sequences that run through one op call: their tokens and where
// their conv and recurrent states (and, for speculative verification, step states) are.
struct KdaSeqGroup {
  std::vector<int32_t> start, len;
  std::vector<float*> conv_q, conv_k, conv_v, state;
  std::vector<float*> step_q, step_k, step_v, step_state;  // kept step states only
};

struct LayerWeights {
  std::vector<float> input_layernorm, post_attention_layernorm;  // [hidden]
  MlaWeights attn;                                               // MLA layers
  std::optional<KdaWeights> kda;                                 // KDA layers (then attn is empty)
  int64_t cache_layer = -1;                                      // MLA: its layer in the latent cache
  // K3 attention residuals: a norm weight [hidden] and a projection [1, hidden] per mix site;
  // res_*_mix = their product, the one vector the mix uses.
  std::vector<float> res_attn_norm, res_attn_proj, res_attn_mix;
  std::vector<float> res_mlp_norm, res_mlp_proj, res_mlp_mix;
  std::optional<MlpWeights> dense_mlp;
  std::optional<MoeWeights> moe;
};

// What a step can hand back besides logits, and an MTP head's second input.
struct ForwardExtras {
  // [T, hidden] MTP heads only: the main model's final normed hidden state at each row's position
  const float* mtp_prev_hidden = nullptr;
  float* final_hidden = nullptr;  // [T, hidden] out: every row's final normed hidden state
  float* residual = nullptr;      // [T, hidden] out: the residual stream after the last layer
  // Models with recurrent state (state_bytes_per_request() > 0): the pool that holds the slots
  // named by ForwardBatch::state_slots; each slot's state is read and advanced in place.
  StateSlotPool* states = nullptr;
  // Speculative verification: keep the state after every token of each short sequence (up to
  // kMaxStepTokens), so rewind_state can put a request back at its accepted position.
  bool keep_step_states = false;
};

// Expert parallelism's split: the routed experts rank `rank` of `tp` holds, [first, last). Every
// expert on exactly one rank; when tp does not divide the count, some ranks hold one more.
std::pair<int64_t, int64_t> expert_range_of_rank(int64_t experts, int tp, int rank);

class DeepseekModel {
 public:
  struct Options {
    ops::Backend backend = ops::Backend::cpu;
    int64_t max_context = 4096;  // RoPE table length; prompts + outputs must fit
    bool exact_activations = false;  // fp32-accurate activations in every matmul (OpTable::set_exact_activations: per model)
    WeightPlacement weights = WeightPlacement::mmap;  // see loader/safetensors.h
    DType kv_dtype = DType::BF16;  // the paged latent cache's element type (the op table is resolved for it)
    // Threads this model's kernels split over (0: hardware threads). Per model: a draft and a
    // target model in one process each keep theirs (models of one size share one pool).
    int threads = 0;
    // Load the checkpoint's first MTP head (model.layers.{num_hidden_layers}) as a one-layer
    // model instead of the main model: the proposer of --speculative mtp (spec/mtp_proposer.h).
    bool mtp = false;
    // Tensor parallelism (issue 15): this process is rank comm->rank() of comm->size(), and holds
    // its share of the weights as the weight table's TpSplit says: its heads of every MLA layer,
    // its slice of every MLP's and expert's intermediate width, its rows of lm_head; the latent
    // cache and the router replicated. One all-reduce after each attention and each MLP / MoE.
    // Rank 0 runs forward as usual; the other ranks run run_tp_worker(). Null: one rank.
    std::shared_ptr<Communicator> comm;
    // With comm: routed experts split by expert (EP: rank r holds experts [E r / tp, E (r + 1) / tp),
    // whole; an uneven E just gives some ranks one more) instead of each expert's intermediate width
    // split across the ranks (TP). Shared experts and dense MLPs stay TP. Still one all-reduce per
    // MoE layer.
    bool expert_parallel = false;
    // Copy the weight matrices whose rows start off a cache line (a safetensors header pads only
    // to 8 bytes) into one aligned arena at load (base/weight.h realign_weights; mapped
    // checkpoints drop their pages of what was copied). Mapped checkpoints larger than
    // fits_in_memory() stay as they are: anonymous copies could not be paged out.
    bool realign_weights = true;
  };

  ~DeepseekModel();

  static Result<std::unique_ptr<DeepseekModel>> load(const std::filesystem::path& dir, const Options& options);

  const ModelConfig& config() const { return config_; }
  const ops::OpTable& ops() const { return ops_; }
  // Attaches an op profile to this model's forwards (nullptr detaches): model_bench --profile.
  void set_op_profile(ops::OpProfile* profile) { ops_.set_profile(profile); }
  // The pool forward runs on. Code that runs this model's ops outside forward (the engine's
  // sampling) installs it too: ScopedThreadPool scope(model.thread_pool()).
  ThreadPool& thread_pool() const { return *pool_; }
  int64_t max_context() const { return options_.max_context; }
  bool is_mtp() const { return options_.mtp; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Weights one decode token streams (active experts only, plus the embedding row), for
  // rooflines: bytes read from memory and parameters multiplied (2 FLOPs each).
  struct ActiveWeights {
    int64_t bytes = 0;
    int64_t params = 0;
  };
  ActiveWeights active_weights_per_token() const;
  // Expected weight bytes one step of `tokens` tokens streams when routing spreads tokens
  // uniformly over the experts (random-weight benchmark checkpoints do): everything but the routed
  // experts once, plus each MoE layer's experts touched by at least one of the tokens' top-k,
  // E * (1 - (1 - k/E)^tokens) of them. tokens = 1 gives active_weights_per_token().bytes.
  double weight_bytes_per_step(int64_t tokens) const;
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  // The matrix this model bound for weight-table tensor `name` (after its tensor-parallel split and
  // any realigning), or nullptr when the name is not one of its matrices.
  const WeightMatrix* weight_matrix(std::string_view name) const;
  // Bytes of weights copied at load to start on a cache line (Options::realign_weights).
  int64_t realigned_weight_bytes() const { return static_cast<int64_t>(realigned_.size()); }
  // The memory this rank's weight matrices are read from (data and scales), as address-ordered
  // ranges (merged within each checkpoint file): the checkpoint's mapping or copy where
  // matrices are views of it, the realigned and column-sliced copies where not. For bandwidth
  // probes of the memory decode streams.
  std::vector<std::pair<const std::byte*, size_t>> weight_memory() const;
  // Resident bytes of the checkpoint's files and the realigned copies, and how many sit in 2 MiB
  // pages.
  MappingPageStats weight_page_stats() const;
  // The architecture's weight table for this config (models/registry.h).
  const WeightSpec& weight_spec() const { return spec_; }

  // Recurrent state a request keeps beside its latent rows (kv/state_pool.h): the KDA layers'
  // conv inputs and fp32 states (ModelConfig::state_bytes_per_request); 0 when every layer is MLA.
  // Under tensor parallelism: this rank's share (its KDA heads), as the engine sizes its pool.
  int64_t state_bytes_per_request() const { return state_bytes_per_request_; }
  // The latent cache holds the MLA layers only (KDA layers keep state instead).
  LatentCacheShape cache_shape() const {
    return {num_mla_layers_, config_.kv_cache_dim(), options_.kv_dtype};
  }
  // After a forward with keep_step_states: sets the state slot of the batch's sequence `seq` to its
  // state after its first `kept_tokens` tokens of that step (1 <= kept_tokens <= its length), as
  // if only those had run. Speculative decoding calls it when guesses were rejected.
  static constexpr int64_t kMaxStepTokens = 65;
  void rewind_state(int32_t seq, int64_t kept_tokens, StateSlotPool& states, int32_t slot) const;
  // Hybrid prefix caching under tensor parallelism: rank 0's scheduler saved the state of `slot`
  // under `hash` in its StateSnapshotCache of `capacity` (save), or restored it from there into
  // `slot` (restore). Each worker does the same to its own share of the state in a mirror cache,
  // in the same order, so both evict alike. A no-op without tensor parallelism or off rank 0.
  void mirror_state_snapshot(const StateSlotPool& states, int32_t capacity, bool save, uint64_t hash,
                             int32_t slot) const;
  // A cache for one sequence of up to `capacity` tokens (score, tests, benchmarks), with its
  // state slot when the model keeps state.
  SequenceCache new_sequence_cache(int64_t capacity, int32_t block_size = 64) const {
    return SequenceCache(cache_shape(), capacity, block_size, state_bytes_per_request());
  }

  // Tensor parallelism: this rank's place in the group (1 and 0 without Options::comm), and the
  // attention heads this rank computes (num_attention_heads / tp).
  int tp_size() const { return tp_; }
  int tp_rank() const { return tp_rank_; }
  const Communicator* communicator() const { return comm_.get(); }
  int64_t heads_per_rank() const { return heads_; }
  // Checkpoint bytes this rank holds: its share of every matrix (whole experts under EP, only its
  // own) and vectors at the checkpoint's 2 bytes per value; `moat plan`'s weights per GPU at
  // this TP degree must agree (tests/dist).
  int64_t weight_bytes_on_rank() const;
  // The routed experts this rank computes, [first, last): all of them unless expert_parallel.
  std::pair<int64_t, int64_t> experts_of_rank() const { return {expert_begin_, expert_end_}; }
  // Ranks other than 0: runs every step rank 0's forward sends, on caches of the same geometry as
  // rank 0's (the latent cache is replicated: the same block ids hold the same rows on every rank),
  // until rank 0's model is destroyed. Waiting between steps sleeps instead of spinning.
  void run_tp_worker();

  // Runs one step: writes the batch's latent rows into `cache` (slot_mapping) and attends over
  // each sequence's blocks. logits: [batch.logit_rows.size(), vocab]. on_layer_output, when set,
  // sees the residual stream [T, hidden] after each decoder layer (golden tests compare it with
  // the reference).
  using LayerHook = std::function<void(int64_t layer, const float* hidden, int64_t T)>;
  void forward(const ForwardBatch& batch, PagedLatentCache& cache, float* logits,
               const LayerHook& on_layer_output = nullptr, const ForwardExtras& extras = {});
  // One sequence's tokens at positions first_position.. over a SequenceCache.
  void forward(SequenceCache& cache, std::span<const int32_t> tokens, int32_t first_position, float* logits,
               ForwardBatch::Logits which = ForwardBatch::Logits::last, const LayerHook& on_layer_output = nullptr) {
    ForwardBatch batch = ForwardBatch::for_sequence(tokens, first_position, cache.blocks, cache.pages.block_size(), which);
    batch.state_slots = {cache.state_slot};
    forward(batch, cache.pages, logits, on_layer_output, {.states = &cache.states});
  }

 private:
  DeepseekModel() = default;
  // The step itself, run by every rank (forward sends it to the workers first).
  void forward_local(const ForwardBatch& batch, PagedLatentCache& cache, float* logits, const LayerHook& on_layer_output,
                     const ForwardExtras& extras);
  // Rank 0: sends a step to the worker ranks; `command` 0 = forward, 1 = shut down.
  void send_tp_step(int64_t command, const ForwardBatch* batch, const PagedLatentCache* cache,
                    const ForwardExtras* extras = nullptr);
  // This rank's share of a bound tensor, as its TpSplit says.
  Status shard_matrix(const TensorSpec& t, WeightMatrix& m);
  // Sums a sublayer's partial output [n] across the ranks (nothing at tp 1).
  void all_reduce(float* data, int64_t n) {
    if (tp_ > 1) comm_->all_reduce_sum(data, n);
  }
  // Binds every tensor of spec_ to its member, then derives the absorbed per-head copies.
  Status load_weights();
  void realign_matrices();  // Options::realign_weights, after every matrix is bound and sharded
  // Where a spec entry lives in this model; optional parts are created as their tensors arrive.
  WeightMatrix* matrix_slot(const TensorSpec& t);
  std::vector<float>* vector_slot(const TensorSpec& t);
  void absorb_kv_b(MlaWeights& A);
  void attention(const LayerWeights& layer, const ForwardBatch& batch, PagedLatentCache& cache, const float* x,
                 float* out);
  // Kimi Delta Attention of one layer (models/kda_attention.cpp); kda_index: its place among the
  // KDA layers, which fixes where its state sits in each request's slot.
  void kda_attention(const KdaWeights& w, int64_t kda_index, const ForwardBatch& batch, StateSlotPool& states,
                     const float* x, float* out);
  // gate/up: scratch [T, intermediate] each.
  void mlp(const MlpWeights& w, const float* x, int64_t T, float* out, float* gate, float* up);
  // gate[T, n] = act(gate) * up: SiLU, or K3's SiTU (config hidden_act)
  void gated_activation(float* gate, const float* up, int64_t T, int64_t n);
  // out[T, hidden] = the AttnRes mix of rows (bank rows then the running sum P) with weight [hidden]
  void attn_res_mix(const float* const* rows, int64_t num_rows, int64_t T, const std::vector<float>& weight, float* out);
  void moe(const MoeWeights& w, const float* x, int64_t T, float* out);
  void reserve(int64_t T);

  Options options_;
  ModelConfig config_;
  WeightSpec spec_;
  // [spec_.tensors.size()]: the bound matrix of each entry (nullptr for vectors), for the counts.
  std::vector<const WeightMatrix*> bound_;
  std::unique_ptr<Checkpoint> checkpoint_;
  ops::OpTable ops_;
  std::shared_ptr<ThreadPool> pool_;
  RopeTable rope_;
  float softmax_scale_ = 1.0f;
  WeightMatrix embed_tokens_, lm_head_;
  std::vector<float> final_norm_;
  // MTP heads only (Options::mtp): norms of the next token's embedding and of the main model's
  // hidden state, and the projection of both into the decoder layer's input
  std::vector<float> mtp_enorm_, mtp_hnorm_;  // [hidden]
  WeightMatrix mtp_eh_proj_;                  // [hidden, 2 * hidden]
  Buffer mtp_cat_;                            // [T, 2 * hidden]
  std::vector<LayerWeights> layers_;

  // Workspace, grown by reserve(T) and reused across steps.
  int64_t reserved_tokens_ = 0;
  Buffer x_, h_, tmp_, q_, q_lora_, kv_, q_full_, attn_latent_, attn_v_;
  Buffer mlp_gate_, mlp_up_, router_logits_;
  // K3: the attention-residual bank [rows, T, hidden], the mixed sublayer input, the output
  // mix's weights; the latent MoE's z and expert sum [T, latent]; MLA's output gate [T, heads * v]
  Buffer res_bank_, res_mixed_, latent_z_, latent_sum_, latent_up_, attn_gate_;
  std::vector<float> res_output_norm_, res_output_proj_, res_output_mix_;
  Buffer logits_in_;
  std::vector<int32_t> topk_ids_;   // [T, top_k]
  std::vector<float> topk_weights_;  // [T, top_k]
  std::vector<int32_t> kv_lens_;  // [T] rows each token attends to (its position + 1)
  // KDA workspace: q, k, v after projection and after the conv [T, width] each, gate and output
  Buffer kda_proj_, kda_q_, kda_k_, kda_v_, kda_low_, kda_gate_low_, kda_g_, kda_beta_, kda_out_, kda_gate_out_;
  // KDA calls of at most this many tokens project x as one matmul group (kda_proj_ then holds the
  // q, k and v projections side by side); longer ones one projection at a time.
  static constexpr int64_t kKdaGroupMaxTokens = 64;
  std::vector<int64_t> kda_layer_index_;  // [layers] index among the KDA layers, -1 for MLA
  int64_t num_mla_layers_ = 0;            // layers with a latent cache (an MTP head: its one layer)
  // keep_step_states: per sequence of the last step, where its step states start in kda_steps_
  // (-1: none kept) and its length; per KDA layer and sequence, [len] conv states of q, k, v
  // ([conv - 1, width] each) then [len] recurrent states [heads, K, V].
  Buffer kda_steps_;
  std::array<KdaSeqGroup, 3> kda_groups_;  // kda_attention's per-call grouping, reused

  // Tensor parallelism
  std::shared_ptr<Communicator> comm_;
  int tp_ = 1, tp_rank_ = 0;
  bool tp_loaded_ = false;
  int64_t heads_ = 0;             // attention heads on this rank
  int64_t kda_heads_ = 0;         // KDA heads on this rank
  int64_t state_bytes_per_request_ = 0;  // this rank's KDA state per request
  // Floats of one KDA layer's state per request on this rank: the conv inputs of q, k, v, then the
  // fp32 [heads, K, V] state (ModelConfig::kda_state_floats_per_layer at tp 1).
  int64_t kda_state_floats_per_layer() const;
  // Rank 0 tells the workers about a rewind_state (const: it changes no model state here).
  void send_tp_rewind(const StateSlotPool& states, int32_t seq, int64_t kept_tokens, int32_t slot) const;
  int64_t expert_begin_ = 0, expert_end_ = 0;  // routed experts on this rank (expert_parallel)
  int64_t vocab_per_rank_ = 0;    // lm_head rows per rank (the last rank's may be fewer: zero-padded)
  std::deque<OwnedWeightBytes> owned_;  // column slices copied out of the checkpoint
  HugePageBuffer realigned_;             // matrices copied onto cache lines (Options::realign_weights)
  Buffer logits_local_, logits_gathered_;  // [R, vocab_per_rank], [tp, R, vocab_per_rank]
  // Worker ranks: caches mirroring rank 0's, by PagedLatentCache::id(); tp_cache_ids_ is their
  // recency order, which rank 0 keeps too so that it can refuse to step a cache the workers evicted.
  std::vector<std::pair<uint64_t, std::unique_ptr<PagedLatentCache>>> tp_caches_;
  std::vector<std::pair<uint64_t, std::unique_ptr<StateSlotPool>>> tp_pools_;  // the same for state pools
  std::vector<uint64_t> tp_pool_ids_;  // workers: the pools' recency order
  // Workers: mirrors of rank 0's state snapshot caches, by the id of the pool they snapshot.
  std::vector<std::pair<uint64_t, std::unique_ptr<StateSnapshotCache>>> tp_snapshots_;
  std::vector<uint64_t> tp_snapshot_ids_;  // their recency order
  std::vector<uint64_t> tp_cache_ids_, tp_evicted_ids_;
  std::vector<int64_t> kda_step_base_;
  std::vector<int32_t> kda_step_len_;
};

}  // namespace moat
