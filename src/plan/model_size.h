// What a model costs in memory: parameter counts, weight bytes at each storage precision and KV
// bytes per token, for `moat plan`. Sized either from an HF config.json (tensor by tensor, from the
// architecture's weight spec: models/weight_spec.h) or from a catalog entry that gives the totals
// directly (Kimi K3, whose layer layout is not published).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "config/model_config.h"
#include "models/weight_spec.h"

namespace moat::plan {

// How linear weights are stored. Embeddings, lm_head, norms and routers stay bf16 at every
// precision, as in the published FP8 and INT4 checkpoints.
enum class Precision { bf16, fp8, mxfp4, int4 };
inline constexpr int kNumPrecisions = 4;
inline constexpr std::array<std::string_view, kNumPrecisions> kPrecisionNames = {"bf16", "fp8", "mxfp4",
                                                                                 "int4"};
inline std::string_view precision_name(Precision p) { return kPrecisionNames[static_cast<int>(p)]; }
Result<Precision> parse_precision(std::string_view name);

// Bytes to store one [rows, cols] weight matrix:
//   bf16   2 bytes per value;
//   fp8    1 byte per value + one fp32 scale per 128x128 block (ceil on both sides);
//   mxfp4  0.5 byte per value + one 1-byte E8M0 scale per 32 values along a row;
//   int4   0.5 byte per value + one fp16 scale per group of 128 values along a row.
double matrix_bytes(int64_t rows, int64_t cols, Precision p);
// The same per value for totals whose matrix shapes are unknown (dimensions assumed to be
// multiples of the block sizes): bf16 2, fp8 1 + 4/16384, mxfp4 0.53125, int4 0.515625.
double bytes_per_param(Precision p);

// KV cache element type: bf16 (2 bytes), fp8 (1), fp32 (4).
Result<int64_t> kv_dtype_bytes(std::string_view name);

using PerPrecision = std::array<double, kNumPrecisions>;

struct ModelSize {
  std::string id;    // catalog id ("kimi-k3") or the directory given
  std::string name;  // "Kimi K3"
  double total_params = 0;
  double active_params = 0;  // per token: non-routed weights + top-k routed experts
  PerPrecision weight_bytes{};  // everything stored
  // Read from HBM per decoded token at batch 1: active weights minus the embedding table
  // (decode reads one row of it).
  PerPrecision active_weight_bytes{};
  // All routed experts together; a batch of B tokens touches a growing share of them.
  PerPrecision routed_expert_bytes{};
  // What every tensor-parallel rank holds whole, as moat's engine runs it (the weight table's
  // TpSplit::replicated tensors: norms, routers, MLA's q_a / kv_a, KDA's low-rank gate inputs, K3's
  // latent projections; and the embedding, which a lookup reads one row of), and the part of it one
  // decode token reads. Per GPU at TP n: replicated + (all - replicated) / n.
  PerPrecision replicated_bytes{}, active_replicated_bytes{};
  int64_t n_routed_experts = 0;   // 0: dense
  int64_t experts_per_token = 0;  // routed experts each token uses

  // Attention heads; they decide heads per rank and kernel padding.
  int64_t num_attention_heads = 0;
  // Per-token KV cache. MLA: kv_layers x (kv_lora_rank + qk_rope_head_dim) values, the same
  // latent on every rank under plain TP. GQA: kv_layers x 2 (K and V) x kv_heads x head_dim,
  // kv heads split across ranks (at least one per rank).
  bool mla = true;
  int64_t kv_layers = 0;
  int64_t kv_lora_rank = 0, qk_rope_head_dim = 0;  // MLA
  int64_t num_key_value_heads = 0, head_dim = 0;   // GQA
  // Fixed-size state per request (linear-attention layers such as Kimi Delta Attention), split
  // across ranks by head when state_split_by_tp.
  double state_bytes_per_request = 0;
  bool state_split_by_tp = true;

  int64_t max_context = 0;
  Precision default_precision = Precision::bf16;
  std::vector<std::string> estimated;  // catalog fields that are estimates
  std::string note;
  std::optional<ModelConfig> config;  // when sized from a config.json

  // KV bytes per token held by one GPU at tensor-parallel degree tp.
  double kv_bytes_per_token_per_gpu(int64_t tp, int64_t kv_dtype_size) const;
  // The facts model_op_needs() and the registry want (a synthesized config for catalog entries).
  ModelConfig attention_config() const;
};

// Sizes a model tensor by tensor from its architecture's weight spec (MTP layers are not
// counted); errors for an architecture the model registry does not know.
Result<ModelSize> size_from_config(const ModelConfig& config, std::string id, std::string name);
ModelSize size_from_spec(const WeightSpec& spec, std::string id, std::string name);

// A models.json entry: {"id", "name", "config": {...}} or the totals form (see data/models.json).
// Errors name the entry and field.
Result<ModelSize> size_from_catalog_entry(const nlohmann::json& entry);

}  // namespace moat::plan
