// Kimi Delta Attention, one layer (Kimi Linear; ../shared/K3.md), as vLLM runs it:
//   q, k, v = silu(causal_conv(q_proj(x))), ... (per channel, conv state per request)
//   g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)      per-channel log decay
//       (K3: gate_lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)))
//   beta = sigmoid(b_proj(x))                                  per head
//   o = KDA recurrence over q, k (L2-normed, q * K^-0.5), v    fp32 state [K, V] per head
//   out = o_proj(rms_norm(o per head) * o_norm * sigmoid(g_b(g_a(x))))   (K3: sigmoid(g_proj(x)))
// Each request's state slot holds, per KDA layer: the last conv_width - 1 inputs of q, k and v
// ([conv - 1, width] each), then the recurrent state [heads, K, V]. A fresh slot is zeros, which
// is exactly the start of a sequence (zero conv padding, empty state).
#include <algorithm>

#include "models/deepseek_v3.h"

namespace moat {

namespace {
// Segments at least this long run the chunked kernel (the state is read and written once per
// chunk instead of once per token: 16-18 us/token against 23-28 for the recurrent step at 12 heads
// x 128, 1 thread, kernel_bench); shorter ones, decode tokens, run the recurrent step. The CPU
// kernel's chunks are 8 tokens.
constexpr int32_t kKdaChunkedMinTokens = 8;
}  // namespace

void DeepseekModel::kda_attention(const KdaWeights& w, int64_t kda_index, const ForwardBatch& batch,
                                  StateSlotPool& states, const float* x, float* out) {
  const ModelConfig& c = config_;
  const LinearAttentionConfig& la = *c.linear_attn;
  const int64_t T = batch.num_tokens(), S = batch.num_sequences();
  // this rank's heads (all of them at tp 1)
  const int64_t heads = kda_heads_, K = la.head_dim, width = heads * K, conv = la.short_conv_kernel_size;
  const int64_t conv_floats = (conv - 1) * width, per_layer = kda_state_floats_per_layer();

  // Sequences in three groups, each one op call: kept step states (speculative verification:
  // recurrent, every token's state saved), long segments (prefill chunks: chunked), the rest
  // (decode tokens: recurrent).
  enum Group { stepped, chunked, recurrent_only };
  using Seqs = KdaSeqGroup;
  auto& groups = kda_groups_;  // workspace: cleared, capacity kept across layers and steps
  for (Seqs& g : groups) {
    g.start.clear();
    g.len.clear();
    for (auto* v : {&g.conv_q, &g.conv_k, &g.conv_v, &g.state, &g.step_q, &g.step_k, &g.step_v, &g.step_state})
      v->clear();
  }
  for (int64_t s = 0; s < S; ++s) {
    const int32_t len = batch.query_start[s + 1] - batch.query_start[s];
    if (len <= 0) continue;
    const bool keeps_steps = kda_step_base_[s] >= 0;
    Seqs& g = groups[keeps_steps ? stepped : len >= kKdaChunkedMinTokens ? chunked : recurrent_only];
    float* base = reinterpret_cast<float*>(states.data(batch.state_slots[s])) + kda_index * per_layer;
    g.start.push_back(batch.query_start[s]);
    g.len.push_back(len);
    g.conv_q.push_back(base);
    g.conv_k.push_back(base + conv_floats);
    g.conv_v.push_back(base + 2 * conv_floats);
    g.state.push_back(base + 3 * conv_floats);
    if (keeps_steps) {
      float* steps = kda_steps_.data() + kda_step_base_[s] + kda_index * len * per_layer;
      g.step_q.push_back(steps);
      g.step_k.push_back(steps + len * conv_floats);
      g.step_v.push_back(steps + 2 * len * conv_floats);
      g.step_state.push_back(steps + 3 * len * conv_floats);
    }
  }

  // Every projection of x: q, k, v [T, width] (before their convs), the decay's low rank [T, K], beta
  // logits [T, heads] and the output gate ([T, width] full rank, K3; else its low rank [T, K]).
  // Decode-sized calls run them as one matmul group (one pool dispatch instead of six); prefill
  // chunks one at a time, q / k / v through one buffer (three would be 3 x T x width floats).
  const bool grouped = T <= kKdaGroupMaxTokens;
  float* proj_q = kda_proj_.data();
  float* proj_k = grouped ? proj_q + T * width : proj_q;
  float* proj_v = grouped ? proj_k + T * width : proj_q;
  float* gate_low = kda_gate_low_.data();
  float* gate_dst = w.g_proj ? kda_gate_out_.data() : gate_low;
  const WeightMatrix& gate_proj = w.g_proj ? *w.g_proj : w.g_a_proj;
  if (grouped)
    ops_.matmul_group(x, T, {{&w.q_proj, proj_q}, {&w.k_proj, proj_k}, {&w.v_proj, proj_v},
                             {&w.f_a_proj, kda_low_.data()}, {&w.b_proj, kda_beta_.data()}, {&gate_proj, gate_dst}});
  // q, k, v: the causal conv + SiLU, each with its own conv state  [T, width]
  auto project_conv = [&](const WeightMatrix& proj, float* projected, const std::vector<float>& conv_w,
                          std::vector<float*> Seqs::*conv_state, std::vector<float*> Seqs::*step, float* y) {
    if (!grouped) ops_.matmul(x, T, proj, projected);
    for (Seqs& g : groups) {
      if (g.start.empty()) continue;
      ops_.short_conv({.x = projected, .x_stride = width, .num_tokens = T, .channels = width, .width = conv,
                       .weight = conv_w.data(), .num_seqs = static_cast<int64_t>(g.start.size()),
                       .seq_start = g.start.data(), .seq_len = g.len.data(), .states = (g.*conv_state).data(),
                       .y = y, .y_stride = width, .step_states = (g.*step).empty() ? nullptr : (g.*step).data()});
    }
  };
  project_conv(w.q_proj, proj_q, w.q_conv, &Seqs::conv_q, &Seqs::step_q, kda_q_.data());
  project_conv(w.k_proj, proj_k, w.k_conv, &Seqs::conv_k, &Seqs::step_k, kda_k_.data());
  project_conv(w.v_proj, proj_v, w.v_conv, &Seqs::conv_v, &Seqs::step_v, kda_v_.data());

  // Decay g [T, width] and beta logits [T, heads]
  if (!grouped) ops_.matmul(x, T, w.f_a_proj, kda_low_.data());
  ops_.matmul(kda_low_.data(), T, w.f_b_proj, kda_g_.data());
  ops_.kda_gate({.raw = kda_g_.data(), .num_tokens = T, .num_heads = heads, .head_dim = K, .a_log = w.a_log.data(),
                 .dt_bias = w.dt_bias.data(), .lower_bound = static_cast<float>(la.gate_lower_bound),
                 .g = kda_g_.data()});
  if (!grouped) ops_.matmul(x, T, w.b_proj, kda_beta_.data());

  for (int group : {stepped, chunked, recurrent_only}) {
    Seqs& g = groups[group];
    if (g.start.empty()) continue;
    const ops::KdaArgs args{.q = kda_q_.data(), .k = kda_k_.data(), .qk_stride = width, .v = kda_v_.data(),
                            .v_stride = width, .g = kda_g_.data(), .beta = kda_beta_.data(), .num_tokens = T,
                            .num_heads = heads, .head_k = K, .head_v = K,
                            .num_seqs = static_cast<int64_t>(g.start.size()), .seq_start = g.start.data(),
                            .seq_len = g.len.data(), .states = g.state.data(), .out = kda_out_.data(),
                            .step_states = group == stepped ? g.step_state.data() : nullptr};
    if (group == chunked) ops_.kda_chunked(args); else ops_.kda_recurrent(args);
  }

  // Output gate (K3: full rank), per-head norm, projection
  if (!grouped) ops_.matmul(x, T, gate_proj, gate_dst);
  if (!w.g_proj) ops_.matmul(gate_low, T, w.g_b_proj, kda_gate_out_.data());
  // eps 1e-5: vLLM and sglang build o_norm with the class default, not config.rms_norm_eps (HF
  // passes the config's; the published config says 1e-5, so all agree there). 1e-6 instead moves
  // the tiny golden's logits by ~1 relative: the per-head outputs are small.
  constexpr float kOutputNormEps = 1e-5f;
  ops_.gated_rms_norm({.x = kda_out_.data(), .gate = kda_gate_out_.data(), .weight = w.o_norm.data(), .num_tokens = T,
                       .num_heads = heads, .head_dim = K, .eps = kOutputNormEps, .y = kda_out_.data()});
  ops_.matmul(kda_out_.data(), T, w.o_proj, out);
}

void DeepseekModel::rewind_state(int32_t seq, int64_t kept_tokens, StateSlotPool& states, int32_t slot) const {
  const ModelConfig& c = config_;
  MOAT_CHECK(seq >= 0 && seq < static_cast<int32_t>(kda_step_base_.size()) && kda_step_base_[seq] >= 0,
             "sequence {} of the last step kept no step states (forward with keep_step_states, at most {} tokens)", seq,
             kMaxStepTokens);
  const int64_t len = kda_step_len_[seq];
  MOAT_CHECK(kept_tokens >= 1 && kept_tokens <= len, "cannot keep {} of a sequence's {} tokens", kept_tokens, len);
  if (tp_ > 1 && tp_rank_ == 0) send_tp_rewind(states, seq, kept_tokens, slot);  // the workers rewind their share too
  const LinearAttentionConfig& la = *c.linear_attn;
  const int64_t width = kda_heads_ * la.head_dim, conv_floats = (la.short_conv_kernel_size - 1) * width;
  const int64_t state_floats = kda_heads_ * la.head_dim * la.head_dim, per_layer = kda_state_floats_per_layer();
  float* slot_base = reinterpret_cast<float*>(states.data(slot));
  const int64_t i = kept_tokens - 1;
  // Host copies: the state pool and the step states are host memory (the CUDA backend keeps no
  // model state yet).
  for (int64_t layer = 0; layer < c.num_kda_layers(); ++layer) {
    const float* steps = kda_steps_.data() + kda_step_base_[seq] + layer * len * per_layer;
    float* dst = slot_base + layer * per_layer;
    for (int part = 0; part < 3; ++part)  // conv inputs of q, k, v
      std::copy_n(steps + part * len * conv_floats + i * conv_floats, conv_floats, dst + part * conv_floats);
    std::copy_n(steps + 3 * len * conv_floats + i * state_floats, state_floats, dst + 3 * conv_floats);
  }
}

}  // namespace moat
