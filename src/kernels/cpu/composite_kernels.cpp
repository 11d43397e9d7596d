// CPU kernels of the composite ops (moe_experts, head_matmul): the loops the model used to run
// itself, now behind the registry so model code is the same on every backend. They do no
// arithmetic of their own: every multiply goes through the op table's resolved matmul, silu_mul
// (situ_mul for Kimi K3) and add_scaled (InnerOps), so they are as fast as those on any ISA and
// need none themselves.
// What they add is the schedule: how rows are grouped and how the pool is split, one dispatch
// where the model used to issue one per head or per expert.
#include <algorithm>
#include <cstring>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

namespace moat::ops {
namespace {

MatmulFn matmul_for(const InnerOps& inner, DType dtype) {
  MatmulFn fn = inner.matmul_by_dtype ? inner.matmul_by_dtype[static_cast<int>(dtype)] : nullptr;
  MOAT_CHECK(fn != nullptr, "no matmul resolved for {} weights", dtype_name(dtype));
  return fn;
}

// Per-call scratch of the calling thread: grows to the largest step, then is reused.
struct MoeScratch {
  std::vector<int64_t> expert_begin, fill;  // [E + 1], [E]: rows [begin[e], begin[e+1]) are e's
  std::vector<int64_t> row_of;              // [T * K]: the grouped row of (t, k)
  std::vector<int32_t> active;              // experts with at least one row
  AlignedVector<float> in, out;             // [T * K, hidden] grouped inputs, expert outputs
  AlignedVector<float> gate, up;            // [T * K, intermediate]
  std::vector<int32_t> order, bin_of;       // side by side: active experts by rows, each one's thread bin
  std::vector<int64_t> bin_cost;            // [threads]
};

// Experts with at most this many rows each run side by side (see moe_experts_cpu): up to here an
// expert's matmuls stay on the decode tiles, where one thread streams the weights at full speed.
constexpr int64_t kSideBySideMaxRows = 16;
// Experts with more rows (prefill) run side by side too where the threads' bins come out within
// this fraction of an even share: each matmul split across the pool cost three pool dispatches
// and waits per expert (~190 a layer at 512 tokens on 64 experts). Bench checkpoint, 512-token
// prefill, 2 threads (~48 rows an expert), alternating runs: routed experts 569 -> 529 and
// 506 -> 455 ms.
constexpr double kSideBySideImbalance = 0.1;
// The cost of streaming an expert's weights, in rows of dot products, for balancing threads.
constexpr int64_t kExpertFixedRows = 4;

// One bin of the active experts per thread (s.order, s.bin_of, s.bin_cost), balanced by cost:
// longest first, each to the cheapest bin. An expert costs its weights' streaming, about
// kExpertFixedRows rows' worth of dot products on the decode tiles, plus its rows. Returns the
// costliest bin over an even share.
double balance_bins(MoeScratch& s, int64_t threads) {
  auto rows_of = [&](int32_t e) { return s.expert_begin[e + 1] - s.expert_begin[e]; };
  s.order.assign(s.active.begin(), s.active.end());
  std::stable_sort(s.order.begin(), s.order.end(), [&](int32_t a, int32_t b) { return rows_of(a) > rows_of(b); });
  s.bin_of.resize(s.order.size());
  s.bin_cost.assign(static_cast<size_t>(threads), 0);
  int64_t total = 0;
  for (size_t i = 0; i < s.order.size(); ++i) {
    const auto cheapest = std::min_element(s.bin_cost.begin(), s.bin_cost.end()) - s.bin_cost.begin();
    s.bin_of[i] = static_cast<int32_t>(cheapest);
    s.bin_cost[cheapest] += kExpertFixedRows + rows_of(s.order[i]);
    total += kExpertFixedRows + rows_of(s.order[i]);
  }
  const int64_t worst = *std::max_element(s.bin_cost.begin(), s.bin_cost.end());
  return static_cast<double>(worst * threads) / static_cast<double>(std::max<int64_t>(1, total));
}

void moe_experts_cpu(const MoeExpertsArgs& a, const InnerOps& inner) {
  const int64_t T = a.num_tokens, H = a.hidden, K = a.top_k, E = a.num_experts, I = a.intermediate;
  if (T == 0 || K == 0) return;
  thread_local MoeScratch caller_scratch;
  MoeScratch& s = caller_scratch;  // a reference: pool workers must see the caller's, not their own
  const int64_t R = T * K;
  // Counting sort of the routed rows by expert, so each expert's weights stream from memory once
  // per call however many tokens chose it.
  // Rows of experts held by other ranks (id -1, expert parallelism) get no row: row_of -1.
  s.expert_begin.assign(static_cast<size_t>(E + 1), 0);
  bool skipped = false;
  for (int64_t i = 0; i < R; ++i) {
    const int32_t e = a.topk_ids[i];
    if (e == -1) {
      skipped = true;
      continue;
    }
    MOAT_CHECK(e >= 0 && e < E, "expert id {} outside {} experts", e, E);
    ++s.expert_begin[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) s.expert_begin[e + 1] += s.expert_begin[e];
  s.fill.assign(s.expert_begin.begin(), s.expert_begin.end() - 1);
  s.row_of.resize(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) s.row_of[i] = a.topk_ids[i] == -1 ? -1 : s.fill[a.topk_ids[i]]++;
  s.active.clear();
  for (int64_t e = 0; e < E; ++e)
    if (s.expert_begin[e + 1] > s.expert_begin[e]) s.active.push_back(static_cast<int32_t>(e));
  auto grow = [](AlignedVector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  };
  grow(s.out, R * H);
  grow(s.gate, R * I);
  grow(s.up, R * I);
  // One token (decode of one stream): every expert's single row is x itself, nothing to gather.
  const bool gather = T > 1 || skipped;
  if (gather) {
    grow(s.in, R * H);
    for (int64_t i = 0; i < R; ++i)
      if (s.row_of[i] >= 0) std::memcpy(&s.in[s.row_of[i] * H], a.x + (i / K) * H, sizeof(float) * H);
  }

  const SiluMulFn silu_mul = inner.silu_mul;
  MOAT_CHECK(silu_mul != nullptr && inner.add_scaled != nullptr, "moe_experts needs silu_mul and add_scaled");
  MOAT_CHECK(a.activation != GatedActivation::situ || inner.situ_mul != nullptr,
             "moe_experts with the SiTU activation needs InnerOps::situ_mul (ModelOpNeeds::k3_ops)");
  auto run_expert = [&](int32_t e) {
    const MlpWeights& w = a.experts[e];
    const int64_t row0 = s.expert_begin[e], rows = s.expert_begin[e + 1] - row0;
    const float* x = gather ? &s.in[row0 * H] : a.x;
    float* gate = &s.gate[row0 * I];
    float* up = &s.up[row0 * I];
    matmul_for(inner, w.gate_proj.dtype)(x, rows, w.gate_proj, gate, inner.precision);  // [rows, I]
    matmul_for(inner, w.up_proj.dtype)(x, rows, w.up_proj, up, inner.precision);        // [rows, I]
    if (a.activation == GatedActivation::situ)  // Kimi K3
      inner.situ_mul(gate, up, rows, I, a.situ_beta, a.situ_linear_beta, gate);
    else
      silu_mul(gate, up, rows, I, gate);
    matmul_for(inner, w.down_proj.dtype)(gate, rows, w.down_proj, &s.out[row0 * H], inner.precision);  // [rows, H]
  };
  // Few rows per expert (decode, speculative verification, batched decode, short prompts on small
  // experts): one pool dispatch for the whole layer, experts side by side, each expert's matmuls on
  // one thread. Many rows per expert (prefill): side by side as well where the threads' bins of
  // experts balance (kSideBySideImbalance), otherwise experts in turn, each matmul split across
  // the pool.
  // The rule counts rows per expert, not rows in all: under a limit of 16 rows in all, a 5-token
  // verification on k3-nano (20 rows: ~12 experts of 1-2 rows) ran its experts in turn, 33 tiny
  // pool dispatches per layer, and took 8x the one-token layer.
  ThreadPool& pool = thread_pool();
  const int64_t threads = pool.num_threads();
  int64_t max_rows = 0, min_rows = R;
  for (int32_t e : s.active) {
    max_rows = std::max(max_rows, s.expert_begin[e + 1] - s.expert_begin[e]);
    min_rows = std::min(min_rows, s.expert_begin[e + 1] - s.expert_begin[e]);
  }
  // Experts too small to pay for a dispatch each (k3-nano's MXFP4 ones: 4 of 26 KiB a token) run in turn
  // on this thread; their matmuls are under the matmul's own split threshold as well.
  double active_bytes = 0;
  for (int32_t e : s.active)
    active_bytes += static_cast<double>(a.experts[e].gate_proj.bytes() + a.experts[e].up_proj.bytes() +
                                        a.experts[e].down_proj.bytes());
  const bool can_share = threads > 1 && static_cast<int64_t>(s.active.size()) >= threads &&
                         active_bytes >= static_cast<double>(threads * min_parallel_chunk_bytes());
  const bool one_token = min_rows == max_rows && max_rows <= kSideBySideMaxRows;
  bool binned = false;  // side by side in the bins balance_bins filled (s.order, s.bin_of)
  if (can_share && !one_token)
    binned = balance_bins(s, threads) <= 1.0 + kSideBySideImbalance || max_rows <= kSideBySideMaxRows;
  if (can_share && one_token) {  // one token's experts: equal shares of the pool
    pool.parallel_for(static_cast<int64_t>(s.active.size()), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) run_expert(s.active[i]);
    });
  } else if (binned) {
    pool.parallel_for(threads, [&](int64_t b0, int64_t b1) {
      for (size_t i = 0; i < s.order.size(); ++i)
        if (s.bin_of[i] >= b0 && s.bin_of[i] < b1) run_expert(s.order[i]);
    });
  } else {
    for (int32_t e : s.active) run_expert(e);
  }
  // Combine per token, k in order (the reference's order): tokens never share an output row, so
  // they split across the pool without atomics.
  pool.parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (s.row_of[t * K + k] >= 0)
          inner.add_scaled(a.out + t * H, &s.out[s.row_of[t * K + k] * H], a.topk_weights[t * K + k], H);
  }, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * H)));
}

void head_matmul_cpu(const HeadMatmulArgs& a, const InnerOps& inner) {
  const int64_t T = a.num_tokens, heads = a.num_heads;
  if (T == 0 || heads == 0) return;
  const WeightMatrix& w0 = a.weights[0];
  const int64_t in = w0.in_features, out = w0.out_features;
  const MatmulFn matmul = matmul_for(inner, w0.dtype);
  auto run_head = [&](int64_t h) {
    const WeightMatrix& w = a.weights[h];
    MOAT_CHECK(w.dtype == w0.dtype && w.in_features == in && w.out_features == out,
               "head_matmul: head {} weight differs from head 0's", h);
    const float* x = a.x + h * a.x_head_stride;
    float* y = a.y + h * a.y_head_stride;
    if (T == 1) {
      matmul(x, 1, w, y, inner.precision);  // one token: its head slices are contiguous already
    } else {
      thread_local AlignedVector<float> xs, ys;  // [T, in], [T, out]
      if (static_cast<int64_t>(xs.size()) < T * in) xs.resize(static_cast<size_t>(T * in));
      if (static_cast<int64_t>(ys.size()) < T * out) ys.resize(static_cast<size_t>(T * out));
      for (int64_t t = 0; t < T; ++t) std::memcpy(&xs[t * in], x + t * a.x_token_stride, sizeof(float) * in);
      matmul(xs.data(), T, w, ys.data(), inner.precision);
      for (int64_t t = 0; t < T; ++t) std::memcpy(y + t * a.y_token_stride, &ys[t * out], sizeof(float) * out);
    }
    for (int64_t t = 0; t < T && a.pass > 0; ++t)
      std::memcpy(y + t * a.y_token_stride + out, x + t * a.x_token_stride + in, sizeof(float) * a.pass);
  };
  // Heads side by side, each head's matmul on one thread: one pool dispatch per call instead of one
  // per head, which is what decode pays for. With fewer heads than threads, heads in turn and each
  // matmul split across the pool instead.
  ThreadPool& pool = thread_pool();
  if (heads >= pool.num_threads()) {
    pool.parallel_for(heads, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) run_head(h);
    }, grain_for_bytes(static_cast<double>(w0.bytes()) * static_cast<double>(T)));
  } else {
    for (int64_t h = 0; h < heads; ++h) run_head(h);
  }
}

}  // namespace

void register_cpu_composite_kernels(Registry& r) {
  // Any weight dtype some matmul takes: the composite runs the table's matmul for it.
  const Constraints c{
      .weight_dtypes = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32}};
  r.add(KernelEntry{OpId::moe_experts, Backend::cpu, "cpu.moe_experts_grouped",
                    reinterpret_cast<void*>(&moe_experts_cpu), c, 10, {}});
  r.add(KernelEntry{OpId::head_matmul, Backend::cpu, "cpu.head_matmul", reinterpret_cast<void*>(&head_matmul_cpu), c,
                    10, {}});
}

}  // namespace moat::ops
