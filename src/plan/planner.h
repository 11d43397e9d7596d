// The capacity and cost planner behind `moat plan`: for each GPU and tensor-parallel layout, does
// the model plus its KV cache fit, what do the attention kernels need, and what would decode
// speed and cost be on a memory-bandwidth roofline.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/op_list.h"
#include "plan/catalog.h"
#include "plan/model_size.h"

namespace moat::plan {

struct PlanOptions {
  int64_t context = 0;      // tokens held per request (prompt + output)
  int64_t concurrency = 1;  // requests resident at once
  std::optional<Precision> precision;  // unset: the model's default
  std::string kv_dtype = "bf16";
  double headroom = 0.1;    // fraction of each GPU's HBM kept for activations and runtime
  double efficiency = 0.6;  // fraction of HBM bandwidth (and peak FLOPS) decode achieves
  std::vector<int64_t> tp_degrees = {1, 2, 4, 8, 16};
  std::map<std::string, double> prices;  // hardware id -> USD per GPU-hour (overrides the catalog)
  ops::Backend backend = ops::Backend::cpu;  // whose kernels answer the padding question
  // Hybrids: prefix-cache state snapshots per GPU, as the engine's --prefix-state-snapshots; unset:
  // the engine's default (default_state_snapshots, with concurrency as --max-num-seqs).
  std::optional<int64_t> prefix_state_snapshots;
};

// Validates the options; errors name the flag.
Status validate(const PlanOptions& options);

// The backend whose kernels decide padding: cuda when this binary has CUDA kernels, else cpu.
ops::Backend default_plan_backend();

struct PlanRow {
  std::string hardware;  // catalog id
  std::string hardware_name;
  int64_t gpus = 0, nodes = 0, tp = 0;
  int64_t heads_per_rank = 0;
  std::optional<int64_t> attention_pad_to;  // set when the attention kernel zero-pads heads
  std::string attention_dispatch;           // the registry's answer, e.g. "PadHeads{12->16} ..."
  double hbm_gb_per_gpu = 0;
  double weights_gb_per_gpu = 0;
  double headroom_gb_per_gpu = 0;
  double state_gb_per_gpu = 0;        // fixed per-request state x concurrency
  double free_gb_per_gpu = 0;         // HBM - weights - headroom - state (may be negative)
  double kv_bytes_per_token = 0;      // per GPU
  double kv_gb_per_gpu = 0;           // at context x concurrency
  // Hybrids' prefix-cache state snapshots (0 for models without recurrent state): the engine's
  // default count, sized from what is left after the KV at context x concurrency, or the
  // --prefix-state-snapshots option; each holds one request's per-GPU share of state.
  int64_t state_snapshots = 0;
  double snapshot_gb_per_gpu = 0;     // state_snapshots x per-request state per GPU
  int64_t max_kv_tokens = 0;          // per GPU pool, shared by all requests: (free - snapshots) / KV per token
  bool fits = false;
  std::string why_not;                // when !fits
  // Estimates, unset when the model does not fit.
  std::optional<double> decode_tps_per_stream_est;  // batch 1
  std::optional<double> per_stream_tps_at_concurrency_est;
  std::optional<double> aggregate_tps_est;          // at options.concurrency
  double price_per_gpu_hour = 0;
  std::optional<double> usd_per_mtok_est;
};

struct Plan {
  ModelSize model;
  Precision precision = Precision::bf16;
  PlanOptions options;
  std::vector<PlanRow> rows;  // hardware in request order, TP ascending
};

Result<Plan> make_plan(const ModelSize& model, const std::vector<HardwareSpec>& hardware,
                       const PlanOptions& options);

// The first fitting layout of each GPU, or its largest layout when none fits.
std::vector<PlanRow> smallest_fitting(const std::vector<PlanRow>& rows);

// What the chart shows: each GPU's smallest fitting layout, preceded by its one-node layout when
// fitting takes more than one node (so the chart shows why: 8x B200 next to 16x B200).
std::vector<PlanRow> chart_rows(const std::vector<PlanRow>& rows, const std::vector<HardwareSpec>& hardware);

nlohmann::json row_to_json(const PlanRow& row);
nlohmann::json plan_to_json(const std::vector<PlanRow>& rows);
void print_plan(std::FILE* out, const Plan& plan, const std::vector<PlanRow>& rows, bool all);

}  // namespace moat::plan
