#include "plan/planner.h"

#include <algorithm>
#include <cmath>

#include "kv/state_pool.h"
#include "models/op_needs.h"
#include "ops/registry.h"

namespace moat::plan {

using nlohmann::json;

Status validate(const PlanOptions& o) {
  if (o.context <= 0) return make_error("--context: expected a positive number of tokens, got {}", o.context);
  if (o.concurrency <= 0) return make_error("--concurrency: expected >= 1, got {}", o.concurrency);
  if (!(o.headroom >= 0 && o.headroom < 1))
    return make_error("--headroom: expected a fraction of HBM in [0, 1), got {}", o.headroom);
  if (!(o.efficiency > 0 && o.efficiency <= 1))
    return make_error("--efficiency: expected a fraction of peak bandwidth in (0, 1], got {}", o.efficiency);
  MOAT_TRY(kv_dtype_bytes(o.kv_dtype));
  if (o.prefix_state_snapshots && *o.prefix_state_snapshots < 0)
    return make_error("--prefix-state-snapshots: expected >= 0 snapshots, got {}", *o.prefix_state_snapshots);
  for (const auto& [gpu, usd] : o.prices)
    if (!(usd >= 0) || !std::isfinite(usd))
      return make_error("--price {}={}: expected a non-negative price in USD per GPU-hour", gpu, usd);
  for (int64_t tp : o.tp_degrees)
    if (tp <= 0) return make_error("tensor-parallel degree must be >= 1, got {}", tp);
  return ok_status();
}

ops::Backend default_plan_backend() {
  for (ops::Backend b : ops::Registry::global().compiled_backends())
    if (b == ops::Backend::cuda) return b;
  return ops::Backend::cpu;
}

namespace {

// Peak dense TFLOPS for matmuls whose weights are stored at p: FP4 units when the GPU has them,
// FP8 for the 4-bit formats otherwise (dequantized on the fly).
double matmul_tflops(const HardwareSpec& h, Precision p) {
  switch (p) {
    case Precision::bf16: return h.bf16_tflops;
    case Precision::fp8: return h.fp8_tflops;
    case Precision::mxfp4:
    case Precision::int4: return h.fp4_tflops.value_or(h.fp8_tflops);
  }
  return h.bf16_tflops;
}

// Seconds per decode step of `batch` requests on one GPU of a TP group: the larger of the
// memory time (weights the batch touches + every request's KV and state) and the compute time.
// Routed experts: a batch of B tokens touches E (1 - (1 - k/E)^B) of them per MoE layer; B = 1
// reads exactly the active weights, the formula DESIGN.md quotes.
double step_seconds(const ModelSize& m, Precision p, const HardwareSpec& h, const PlanOptions& o, int64_t tp,
                    int64_t heads_per_rank, int64_t batch, double kv_per_token, double state_per_request) {
  const int i = static_cast<int>(p);
  double touched_routed = 0;
  if (m.n_routed_experts > 0) {
    const double k_over_e = static_cast<double>(m.experts_per_token) / m.n_routed_experts;
    touched_routed = m.routed_expert_bytes[i] * (1 - std::pow(1 - k_over_e, static_cast<double>(batch)));
    touched_routed -= m.routed_expert_bytes[i] * k_over_e;  // already in active_weight_bytes
  }
  // every rank reads its replicated weights whole (moat's TP: the weight table's TpSplit)
  const double weight_bytes =
      m.active_replicated_bytes[i] + (m.active_weight_bytes[i] - m.active_replicated_bytes[i] + touched_routed) / tp;
  const double cache_bytes = batch * (kv_per_token * static_cast<double>(o.context) + state_per_request);
  const double mem_s = (weight_bytes + cache_bytes) / (o.efficiency * h.hbm_tbps * 1e12);
  // FLOPs: 2 per active weight per token, plus attention over the context (absorbed MLA scores
  // against kv_lora + rope values and accumulates kv_lora values per head).
  const double attn_width = m.mla ? 2.0 * m.kv_lora_rank + m.qk_rope_head_dim : 2.0 * m.head_dim;
  const double attn_flops = 2.0 * heads_per_rank * attn_width * static_cast<double>(o.context) * m.kv_layers;
  const double compute_s = batch * (2 * m.active_params / tp / (matmul_tflops(h, p) * 1e12) +
                                    attn_flops / (h.bf16_tflops * 1e12)) / o.efficiency;
  return std::max(mem_s, compute_s);
}

}  // namespace

Result<Plan> make_plan(const ModelSize& model, const std::vector<HardwareSpec>& hardware, const PlanOptions& o) {
  MOAT_TRY(validate(o));
  Plan plan;
  plan.model = model;
  plan.precision = o.precision.value_or(model.default_precision);
  plan.options = o;
  const int pi = static_cast<int>(plan.precision);
  MOAT_ASSIGN_OR_RETURN(const int64_t kv_size, kv_dtype_bytes(o.kv_dtype));
  const ModelConfig attention = model.attention_config();
  for (const auto& [gpu, usd] : o.prices) MOAT_TRY(find_hardware(hardware, gpu));

  for (const HardwareSpec& h : hardware) {
    double price = h.price_per_gpu_hour;
    for (const auto& [gpu, usd] : o.prices)
      if (find_hardware({h}, gpu).ok()) price = usd;
    for (int64_t tp : o.tp_degrees) {
      PlanRow r;
      r.hardware = h.id;
      r.hardware_name = h.name;
      r.tp = tp;
      r.gpus = tp;
      r.nodes = (tp + h.gpus_per_node - 1) / h.gpus_per_node;
      r.price_per_gpu_hour = price;
      r.hbm_gb_per_gpu = h.hbm_gb;
      // Heads per rank and the attention kernel's answer, from the same code the engine uses at
      // load time, so plan and doctor agree.
      auto needs = model_op_needs(attention, tp);
      if (!needs) {
        r.why_not = needs.error().message;
        r.attention_dispatch = "n/a";
        plan.rows.push_back(std::move(r));
        continue;
      }
      r.heads_per_rank = needs->heads_per_rank;
      if (model.mla) {
        const ops::Resolution res = ops::Registry::global().resolve(
            ops::OpId::mla_attention, o.backend,
            ops::OpShape{.heads_per_rank = needs->heads_per_rank, .head_dim = needs->attention_head_dim});
        if (res.kind == ops::Resolution::Kind::pad_heads) r.attention_pad_to = res.pad_to;
        r.attention_dispatch = res.describe();
      } else {
        r.attention_dispatch = "n/a (GQA attention is not in the kernel registry)";
      }

      const double weights = model.replicated_bytes[pi] + (model.weight_bytes[pi] - model.replicated_bytes[pi]) / tp;
      const double headroom = o.headroom * h.hbm_gb * 1e9;
      const double state_per_request =
          model.state_split_by_tp ? model.state_bytes_per_request / tp : model.state_bytes_per_request;
      const double state = state_per_request * o.concurrency;
      r.kv_bytes_per_token = model.kv_bytes_per_token_per_gpu(tp, kv_size);
      const double tokens = static_cast<double>(o.context) * o.concurrency;
      r.weights_gb_per_gpu = weights / 1e9;
      r.headroom_gb_per_gpu = headroom / 1e9;
      r.state_gb_per_gpu = state / 1e9;
      const double free = h.hbm_gb * 1e9 - weights - headroom - state;
      r.free_gb_per_gpu = free / 1e9;
      const double kv_at_context = r.kv_bytes_per_token * tokens;
      r.kv_gb_per_gpu = kv_at_context / 1e9;
      // Hybrids' prefix-cache state snapshots, counted by the engine's own rule (Engine::create),
      // with what this GPU has left after the KV at context x concurrency as its leftover memory.
      // A cache: by default it takes only what is left, so it never makes a layout not fit, but the
      // KV pool is what remains beside it. An explicit count must fit, as the engine requires.
      double snapshot_bytes = 0;
      if (state_per_request > 0) {
        const int64_t per_state = std::max<int64_t>(1, std::llround(state_per_request));
        r.state_snapshots = o.prefix_state_snapshots.value_or(default_state_snapshots(
            o.concurrency, per_state, static_cast<int64_t>(std::floor(free - kv_at_context))));
        snapshot_bytes = static_cast<double>(r.state_snapshots) * state_per_request;
        r.snapshot_gb_per_gpu = snapshot_bytes / 1e9;
      }
      auto kv_tokens_in = [&](double bytes) {
        return bytes > 0 && r.kv_bytes_per_token > 0 ? static_cast<int64_t>(std::floor(bytes / r.kv_bytes_per_token))
                                                      : int64_t{0};
      };
      r.max_kv_tokens = kv_tokens_in(free - snapshot_bytes);
      if (free <= 0) {
        r.why_not = fmt::format("weights {:.1f} GB + headroom {:.1f} GB{} exceed {:.0f} GB HBM", weights / 1e9,
                                headroom / 1e9, state > 0 ? fmt::format(" + state {:.1f} GB", state / 1e9) : "",
                                h.hbm_gb);
      } else if (static_cast<double>(kv_tokens_in(free)) < tokens) {
        r.why_not = fmt::format("KV for {} tokens ({} x {}) needs {:.1f} GB, {:.1f} GB free", static_cast<int64_t>(tokens), o.context, o.concurrency,
                                r.kv_gb_per_gpu, free / 1e9);
      } else if (static_cast<double>(r.max_kv_tokens) < tokens) {
        r.why_not = fmt::format("KV for {} tokens ({} x {}) needs {:.1f} GB and {} prefix-state snapshots "
                                "(--prefix-state-snapshots) {:.1f} GB, {:.1f} GB free",
                                static_cast<int64_t>(tokens), o.context, o.concurrency, r.kv_gb_per_gpu,
                                r.state_snapshots, r.snapshot_gb_per_gpu, free / 1e9);
      } else {
        r.fits = true;
      }
      if (r.fits) {
        const double s1 = step_seconds(model, plan.precision, h, o, tp, r.heads_per_rank, 1,
                                       r.kv_bytes_per_token, state_per_request);
        const double sb = step_seconds(model, plan.precision, h, o, tp, r.heads_per_rank, o.concurrency,
                                       r.kv_bytes_per_token, state_per_request);
        r.decode_tps_per_stream_est = 1 / s1;
        r.per_stream_tps_at_concurrency_est = 1 / sb;
        r.aggregate_tps_est = o.concurrency / sb;
        r.usd_per_mtok_est = r.gpus * price / 3600 / *r.aggregate_tps_est * 1e6;
      }
      plan.rows.push_back(std::move(r));
    }
  }
  return plan;
}

std::vector<PlanRow> smallest_fitting(const std::vector<PlanRow>& rows) {
  std::vector<PlanRow> out;
  for (size_t i = 0; i < rows.size();) {
    size_t j = i;
    while (j < rows.size() && rows[j].hardware == rows[i].hardware) ++j;
    size_t pick = j - 1;  // none fits: show the largest layout and why
    for (size_t k = i; k < j; ++k)
      if (rows[k].fits) {
        pick = k;
        break;
      }
    out.push_back(rows[pick]);
    i = j;
  }
  return out;
}

std::vector<PlanRow> chart_rows(const std::vector<PlanRow>& rows, const std::vector<HardwareSpec>& hardware) {
  std::vector<PlanRow> out;
  for (const PlanRow& best : smallest_fitting(rows)) {
    if (best.nodes > 1) {
      for (const HardwareSpec& h : hardware)
        if (h.id == best.hardware)
          for (const PlanRow& r : rows)
            if (r.hardware == best.hardware && r.tp == h.gpus_per_node) out.push_back(r);
    }
    out.push_back(best);
  }
  return out;
}

namespace {
json opt(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
}  // namespace

json row_to_json(const PlanRow& r) {
  json j;
  j["hardware"] = r.hardware;
  j["hardware_name"] = r.hardware_name;
  j["gpus"] = r.gpus;
  j["nodes"] = r.nodes;
  j["tp"] = r.tp;
  j["heads_per_rank"] = r.heads_per_rank;
  j["attention_pad_to"] = r.attention_pad_to ? json(*r.attention_pad_to) : json(nullptr);
  j["attention_dispatch"] = r.attention_dispatch;
  j["hbm_gb_per_gpu"] = r.hbm_gb_per_gpu;
  j["weights_gb_per_gpu"] = r.weights_gb_per_gpu;
  j["headroom_gb_per_gpu"] = r.headroom_gb_per_gpu;
  j["state_gb_per_gpu"] = r.state_gb_per_gpu;
  j["free_gb_per_gpu"] = r.free_gb_per_gpu;
  j["kv_bytes_per_token"] = r.kv_bytes_per_token;
  j["kv_gb_per_gpu"] = r.kv_gb_per_gpu;
  j["state_snapshots"] = r.state_snapshots;
  j["snapshot_gb_per_gpu"] = r.snapshot_gb_per_gpu;
  j["max_kv_tokens"] = r.max_kv_tokens;
  j["fits"] = r.fits;
  j["why_not"] = r.fits ? json(nullptr) : json(r.why_not);
  j["decode_tps_per_stream_est"] = opt(r.decode_tps_per_stream_est);
  j["per_stream_tps_at_concurrency_est"] = opt(r.per_stream_tps_at_concurrency_est);
  j["aggregate_tps_est"] = opt(r.aggregate_tps_est);
  j["price_per_gpu_hour"] = r.price_per_gpu_hour;
  j["usd_per_mtok_est"] = opt(r.usd_per_mtok_est);
  return j;
}

json plan_to_json(const std::vector<PlanRow>& rows) {
  json arr = json::array();
  for (const auto& r : rows) arr.push_back(row_to_json(r));
  return arr;
}

namespace {

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return v < 0 ? "-" + out : out;
}

std::string bytes_text(double b) {
  if (b >= 1e12) return fmt::format("{:.2f} TB", b / 1e12);
  if (b < 1e9) return fmt::format("{:.1f} MB", b / 1e6);  // a hybrid's per-request state (Kimi Linear: 44.9 MB)
  return fmt::format("{:.1f} GB", b / 1e9);
}

std::string opt_text(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : std::string("-");
}

}  // namespace

void print_plan(std::FILE* out, const Plan& plan, const std::vector<PlanRow>& rows, bool all) {
  const ModelSize& m = plan.model;
  const PlanOptions& o = plan.options;
  const int pi = static_cast<int>(plan.precision);
  const int64_t kv_size = kv_dtype_bytes(o.kv_dtype).ok() ? *kv_dtype_bytes(o.kv_dtype) : 2;
  fmt::print(out, "Model: {} — {:.0f}B total, {:.1f}B active params; {} weights {}\n", m.name,
             m.total_params / 1e9, m.active_params / 1e9, precision_name(plan.precision),
             bytes_text(m.weight_bytes[pi]));
  if (m.mla)
    fmt::print(out, "KV cache: {} x ({} + {}) x {} B ({}) = {} bytes/token, replicated on every rank under TP\n",
               m.kv_layers, m.kv_lora_rank, m.qk_rope_head_dim, kv_size, o.kv_dtype,
               with_commas(static_cast<int64_t>(m.kv_bytes_per_token_per_gpu(1, kv_size))));
  else
    fmt::print(out, "KV cache: {} layers x 2 x {} kv heads x {} x {} B ({}) = {} bytes/token, kv heads split across ranks\n",
               m.kv_layers, m.num_key_value_heads, m.head_dim, kv_size, o.kv_dtype,
               with_commas(static_cast<int64_t>(m.kv_bytes_per_token_per_gpu(1, kv_size))));
  const bool hybrid = m.state_bytes_per_request > 0;
  if (hybrid) {
    fmt::print(out, "Recurrent state: {} per request{}\n", bytes_text(m.state_bytes_per_request),
               m.state_split_by_tp ? ", split across ranks" : "");
    fmt::print(out, "Prefix-cache state snapshots: {}; max KV tokens is what remains beside them\n",
               o.prefix_state_snapshots
                   ? fmt::format("{} per GPU (--prefix-state-snapshots)", *o.prefix_state_snapshots)
                   : std::string("the engine's default, 2 x concurrency capped at a quarter of the memory left "
                                 "after the KV at context"));
  }
  fmt::print(out, "Request: context {} tokens x concurrency {}; headroom {:.0f}% of HBM; decode efficiency {:.2f} of "
                  "HBM bandwidth; attention kernels from the {} registry\n",
             with_commas(o.context), o.concurrency, o.headroom * 100, o.efficiency, ops::backend_name(o.backend));
  if (m.max_context > 0 && o.context > m.max_context)
    fmt::print(out, "warning: context {} exceeds the model's maximum of {} tokens\n", with_commas(o.context),
               with_commas(m.max_context));
  if (!m.estimated.empty()) {
    std::string list;
    for (const auto& e : m.estimated) list += (list.empty() ? "" : ", ") + e;
    fmt::print(out, "Estimated catalog figures: {}\n", list);
  }
  // Hybrids get a snapshots column (count and their bytes per GPU); other models' table is unchanged.
  fmt::print(out, "\n{:<9} {:>4} {:>5} {:>4} {:>5} {:>4} {:>10} {:>9} {:>9}{} {:>14} {:>4} {:>11} {:>11} {:>7} {:>8}\n",
             "GPU", "GPUs", "nodes", "TP", "heads", "pad", "weights/GPU", "free/GPU", "KV@ctx/GPU",
             hybrid ? fmt::format(" {:>17}", "snapshots/GPU") : "", "max KV tokens", "fits", "tok/s/strm",
             "agg tok/s", "$/GPU-h", "$/Mtok");
  for (const PlanRow& r : rows) {
    fmt::print(out, "{:<9} {:>4} {:>5} {:>4} {:>5} {:>4} {:>8.1f}GB {:>7.1f}GB {:>7.1f}GB{} {:>14} {:>4} {:>11} {:>11} {:>7.2f} {:>8}\n",
               r.hardware_name, r.gpus, r.nodes, r.tp, r.heads_per_rank,
               r.attention_pad_to ? std::to_string(*r.attention_pad_to) : "-", r.weights_gb_per_gpu,
               r.free_gb_per_gpu, r.kv_gb_per_gpu,
               hybrid ? fmt::format(" {:>17}", fmt::format("{} = {}", r.state_snapshots,
                                                           bytes_text(r.snapshot_gb_per_gpu * 1e9)))
                      : "",
               with_commas(r.max_kv_tokens), r.fits ? "yes" : "no",
               opt_text(r.decode_tps_per_stream_est, "{:.1f}"), opt_text(r.aggregate_tps_est, "{:.1f}"),
               r.price_per_gpu_hour, opt_text(r.usd_per_mtok_est, "{:.2f}"));
  }
  // Why each layout was rejected: every shown row that does not fit, and in the default view the
  // next smaller layout of each GPU, so "16 GPUs" comes with the reason 8 were not enough.
  std::vector<const PlanRow*> why;
  for (const PlanRow& r : rows) {
    if (!all && r.fits) {
      const PlanRow* smaller = nullptr;
      for (const PlanRow& c : plan.rows)
        if (c.hardware == r.hardware && c.tp < r.tp && !c.fits) smaller = &c;
      if (smaller) why.push_back(smaller);
    }
    if (!r.fits) why.push_back(&r);
  }
  if (!why.empty()) fmt::print(out, "\n");
  for (const PlanRow* r : why)
    fmt::print(out, "  {} x{} (TP{}, {} node{}) does not fit: {}\n", r->hardware_name, r->gpus, r->tp, r->nodes,
               r->nodes > 1 ? "s" : "", r->why_not);
  fmt::print(out, "\n{}tok/s/strm: batch-1 decode roofline = {:.2f} x HBM bandwidth / (active weight bytes per GPU "
                  "+ KV bytes read per token at the full context); agg tok/s at concurrency {} (experts touched by "
                  "the batch, compute-capped); no communication cost. $/Mtok = GPUs x $/GPU-h / 3600 / agg tok/s x 1e6.\n",
             all ? "" : "Smallest fitting layout per GPU (--all for every layout). ", o.efficiency, o.concurrency);
}

}  // namespace moat::plan
