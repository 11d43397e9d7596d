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
  const int64_t heads = la.num_heads, K = la.head_dim, width = heads * K, conv = la.short_conv_kernel_size;
  const int64_t conv_floats = (conv - 1) * width;

  // Per sequence: its tokens and this layer's part of its state slot.
  std::vector<int32_t> seq_start(static_cast<size_t>(S)), seq_len(static_cast<size_t>(S));
  std::vector<float*> conv_q(static_cast<size_t>(S)), conv_k(static_cast<size_t>(S)), conv_v(static_cast<size_t>(S)),
      recurrent(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    seq_start[s] = batch.query_start[s];
    seq_len[s] = batch.query_start[s + 1] - batch.query_start[s];
    float* base = reinterpret_cast<float*>(states.data(batch.state_slots[s])) + kda_index * c.kda_state_floats_per_layer();
    conv_q[s] = base;
    conv_k[s] = base + conv_floats;
    conv_v[s] = base + 2 * conv_floats;
    recurrent[s] = base + 3 * conv_floats;
  }

  // q, k, v: projection then the causal conv + SiLU, each with its own conv state  [T, width]
  auto project_conv = [&](const WeightMatrix& proj, const std::vector<float>& conv_w, std::vector<float*>& conv_state,
                          float* y) {
    ops_.matmul(x, T, proj, kda_proj_.data());
    ops_.short_conv({.x = kda_proj_.data(), .x_stride = width, .num_tokens = T, .channels = width, .width = conv,
                     .weight = conv_w.data(), .num_seqs = S, .seq_start = seq_start.data(), .seq_len = seq_len.data(),
                     .states = conv_state.data(), .y = y, .y_stride = width});
  };
  project_conv(w.q_proj, w.q_conv, conv_q, kda_q_.data());
  project_conv(w.k_proj, w.k_conv, conv_k, kda_k_.data());
  project_conv(w.v_proj, w.v_conv, conv_v, kda_v_.data());

  // Decay g [T, width] and beta logits [T, heads]
  ops_.matmul(x, T, w.f_a_proj, kda_low_.data());
  ops_.matmul(kda_low_.data(), T, w.f_b_proj, kda_g_.data());
  ops_.kda_gate({.raw = kda_g_.data(), .num_tokens = T, .num_heads = heads, .head_dim = K, .a_log = w.a_log.data(),
                 .dt_bias = w.dt_bias.data(), .lower_bound = static_cast<float>(la.gate_lower_bound),
                 .g = kda_g_.data()});
  ops_.matmul(x, T, w.b_proj, kda_beta_.data());

  // The recurrence: long segments (prefill chunks) through the chunked kernel, the rest stepwise.
  for (const bool chunked : {true, false}) {
    std::vector<int32_t> start, len;
    std::vector<float*> state;
    for (int64_t s = 0; s < S; ++s)
      if ((seq_len[s] >= kKdaChunkedMinTokens) == chunked && seq_len[s] > 0) {
        start.push_back(seq_start[s]);
        len.push_back(seq_len[s]);
        state.push_back(recurrent[s]);
      }
    if (start.empty()) continue;
    const ops::KdaArgs args{.q = kda_q_.data(), .k = kda_k_.data(), .qk_stride = width, .v = kda_v_.data(),
                            .v_stride = width, .g = kda_g_.data(), .beta = kda_beta_.data(), .num_tokens = T,
                            .num_heads = heads, .head_k = K, .head_v = K,
                            .num_seqs = static_cast<int64_t>(start.size()), .seq_start = start.data(),
                            .seq_len = len.data(), .states = state.data(), .out = kda_out_.data()};
    if (chunked) ops_.kda_chunked(args); else ops_.kda_recurrent(args);
  }

  // Output gate (K3: full rank), per-head norm, projection
  if (w.g_proj) {
    ops_.matmul(x, T, *w.g_proj, kda_gate_out_.data());
  } else {
    ops_.matmul(x, T, w.g_a_proj, kda_low_.data());
    ops_.matmul(kda_low_.data(), T, w.g_b_proj, kda_gate_out_.data());
  }
  // eps 1e-5: vLLM and sglang build o_norm with the class default, not config.rms_norm_eps (HF
  // passes the config's; the published config says 1e-5, so all agree there). 1e-6 instead moves
  // the tiny golden's logits by ~1 relative: the per-head outputs are small.
  constexpr float kOutputNormEps = 1e-5f;
  ops_.gated_rms_norm({.x = kda_out_.data(), .gate = kda_gate_out_.data(), .weight = w.o_norm.data(), .num_tokens = T,
                       .num_heads = heads, .head_dim = K, .eps = kOutputNormEps, .y = kda_out_.data()});
  ops_.matmul(kda_out_.data(), T, w.o_proj, out);
}

}  // namespace moat
