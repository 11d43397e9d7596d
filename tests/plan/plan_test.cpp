// The seeds' arithmetic, reproduced from the shipped catalogs (data/*.json), plus parameter
// counts from a published config.json and the errors users see.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <filesystem>
#include <fstream>

#include "kv/state_pool.h"
#include "plan/catalog.h"
#include "plan/chart.h"
#include "plan/measured.h"
#include "plan/planner.h"

namespace moat::plan {
namespace {

using nlohmann::json;

const std::filesystem::path kData = std::filesystem::path(MOAT_SOURCE_DIR) / "data";

std::vector<HardwareSpec> hardware() {
  auto h = load_hardware_catalog(kData / "hardware.json");
  EXPECT_TRUE(h.ok()) << h.error().message;
  return *h;
}

ModelSize catalog_model(const std::string& name) {
  auto models = load_model_catalog(kData / "models.json");
  EXPECT_TRUE(models.ok()) << models.error().message;
  auto m = resolve_model(*models, name);
  EXPECT_TRUE(m.ok()) << m.error().message;
  return *m;
}

Plan k3_plan(const std::string& gpus, int64_t context = 1 << 20) {
  PlanOptions o;
  o.context = context;
  auto hw = select_hardware(hardware(), gpus);
  EXPECT_TRUE(hw.ok()) << hw.error().message;
  auto plan = make_plan(catalog_model("kimi-k3"), *hw, o);
  EXPECT_TRUE(plan.ok()) << plan.error().message;
  return *plan;
}

const PlanRow& row(const Plan& plan, const std::string& gpu, int64_t tp) {
  for (const auto& r : plan.rows)
    if (r.hardware == gpu && r.tp == tp) return r;
  ADD_FAILURE() << "no row " << gpu << " TP" << tp;
  return plan.rows.front();
}

TEST(Catalog, EveryGpuOfTheIssueIsThere) {
  auto hw = hardware();
  for (const char* id : {"h100", "h200", "b200", "b300", "mi300x", "mi325x", "mi355x"})
    EXPECT_TRUE(find_hardware(hw, id).ok()) << id;
  EXPECT_EQ(find_hardware(hw, "H100 SXM")->id, "h100");
  EXPECT_DOUBLE_EQ(find_hardware(hw, "B300")->hbm_gb, 288);
  EXPECT_DOUBLE_EQ(find_hardware(hw, "b200")->hbm_tbps, 8.0);
}

TEST(Catalog, KimiK3WeightsAreAboutOnePointFiveTerabytesAtMxfp4) {
  ModelSize k3 = catalog_model("Kimi K3");
  EXPECT_EQ(k3.default_precision, Precision::mxfp4);
  EXPECT_EQ(k3.num_attention_heads, 96);
  // Sized from its architecture (93 layers, 896 latent experts of 3584 -> 3072): the published 2.8T
  // and the ~104B active of a third-party reading (../shared/K3.md) come out of the spec.
  EXPECT_NEAR(k3.total_params / 2.8e12, 1.0, 0.01);
  EXPECT_NEAR(k3.active_params / 104e9, 1.0, 0.03);
  EXPECT_EQ(k3.kv_layers, 24);
  // 69 KDA layers x (96 heads x 128 x 128 fp32 state + q, k, v conv inputs 3 x 3 x 12288) x 4 bytes
  EXPECT_DOUBLE_EQ(k3.state_bytes_per_request, 69.0 * (96 * 128 * 128 + 3 * 3 * 12288) * 4);
  const double w = k3.weight_bytes[static_cast<int>(Precision::mxfp4)];
  // routed experts at 0.53125 byte/param, the other ~65B parameters (attention, shared experts,
  // latent projections, embeddings) in bf16
  EXPECT_GT(w, 1.5e12);
  EXPECT_LT(w, 1.6e12);
  // Weights + 10% headroom exceed 8x B200 (1.536 TB) on their own.
  EXPECT_GT(w + 0.1 * 1.536e12, 1.536e12);
  // 24 MLA layers x 576 values x 2 bytes.
  EXPECT_DOUBLE_EQ(k3.kv_bytes_per_token_per_gpu(8, 2), 24.0 * 576 * 2);
  EXPECT_FALSE(k3.estimated.empty());
}

TEST(Plan, KimiK3WithOneMillionTokensDoesNotFitOnEightB200) {
  Plan plan = k3_plan("b200");
  const PlanRow& r = row(plan, "b200", 8);
  EXPECT_EQ(r.gpus, 8);
  EXPECT_EQ(r.nodes, 1);
  EXPECT_FALSE(r.fits);
  EXPECT_NE(r.why_not.find("exceed"), std::string::npos) << r.why_not;
}

TEST(Plan, KimiK3WithOneMillionTokensFitsOnEightB300AndEightMI355X) {
  Plan plan = k3_plan("b300,mi355x");
  for (const char* gpu : {"b300", "mi355x"}) {
    const PlanRow& r = row(plan, gpu, 8);
    EXPECT_TRUE(r.fits) << gpu << ": " << r.why_not;
    EXPECT_EQ(r.nodes, 1);
    EXPECT_GE(r.max_kv_tokens, 1 << 20);
    EXPECT_FALSE(row(plan, gpu, 4).fits) << gpu;
  }
  // The smallest fitting layout is one 8-GPU node.
  for (const PlanRow& r : smallest_fitting(plan.rows)) EXPECT_EQ(r.gpus, 8) << r.hardware;
}

TEST(Plan, KimiK3OnB200NeedsSixteenGpusOverTwoNodes) {
  Plan plan = k3_plan("b200");
  auto best = smallest_fitting(plan.rows);
  ASSERT_EQ(best.size(), 1u);
  EXPECT_TRUE(best[0].fits);
  EXPECT_EQ(best[0].gpus, 16);
  EXPECT_EQ(best[0].nodes, 2);
  EXPECT_EQ(best[0].tp, 16);
}

TEST(Plan, KimiK3AtTp8HasTwelveHeadsPerRankAndTheRegistryPadsToSixteen) {
  Plan plan = k3_plan("b300");
  const PlanRow& r = row(plan, "b300", 8);
  EXPECT_EQ(r.heads_per_rank, 12);
  // From the kernel registry (OneOf{4,8} | MultipleOf{16}), not from the planner.
  ASSERT_TRUE(r.attention_pad_to.has_value()) << r.attention_dispatch;
  EXPECT_EQ(*r.attention_pad_to, 16);
}

TEST(Plan, DecodeEstimateIsTheBandwidthRoofline) {
  Plan plan = k3_plan("b300");
  const PlanRow& r = row(plan, "b300", 8);
  ASSERT_TRUE(r.decode_tps_per_stream_est);
  const ModelSize& m = plan.model;
  // each rank reads its share of the split weights and the replicated ones whole (moat's TP)
  const int p = static_cast<int>(Precision::mxfp4);
  const double per_token = m.active_replicated_bytes[p] + (m.active_weight_bytes[p] - m.active_replicated_bytes[p]) / 8 +
                           r.kv_bytes_per_token * (1 << 20) + m.state_bytes_per_request / 8;
  EXPECT_GT(m.active_replicated_bytes[p], 0.0);
  EXPECT_LT(m.active_replicated_bytes[p], m.active_weight_bytes[p]);
  EXPECT_NEAR(*r.decode_tps_per_stream_est, 0.6 * 8e12 / per_token, 1e-6 * *r.decode_tps_per_stream_est);
  ASSERT_TRUE(r.usd_per_mtok_est && r.aggregate_tps_est);
  EXPECT_NEAR(*r.usd_per_mtok_est, 8 * 6.00 / 3600 / *r.aggregate_tps_est * 1e6, 1e-9);
}

TEST(Plan, PriceOverrideAndHeadroom) {
  PlanOptions o;
  o.context = 4096;
  o.prices["B300"] = 1.0;
  o.headroom = 0.2;
  auto plan = make_plan(catalog_model("kimi-k3"), *select_hardware(hardware(), "b300"), o);
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  EXPECT_DOUBLE_EQ(row(*plan, "b300", 8).price_per_gpu_hour, 1.0);
  EXPECT_NEAR(row(*plan, "b300", 8).headroom_gb_per_gpu, 57.6, 1e-9);
}

// deepseek-ai/DeepSeek-V3 config.json as published (auto_map left out).
constexpr char kDeepSeekV3Config[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
  "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
})";

std::filesystem::path write_config(const std::string& name, const std::string& text) {
  auto dir = std::filesystem::temp_directory_path() / ("moat_plan_test_" + name);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << text;
  return dir;
}

TEST(ModelSize, DeepSeekV3FromItsConfigJson) {
  auto dir = write_config("v3", kDeepSeekV3Config);
  auto m = resolve_model({}, dir.string());
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_NEAR(m->total_params / 671e9, 1.0, 0.01) << m->total_params;
  EXPECT_NEAR(m->active_params / 37e9, 1.0, 0.03) << m->active_params;
  EXPECT_EQ(m->default_precision, Precision::fp8);
  EXPECT_DOUBLE_EQ(m->kv_bytes_per_token_per_gpu(1, 2), 70272);
  EXPECT_DOUBLE_EQ(m->kv_bytes_per_token_per_gpu(8, 2), 70272);  // replicated under TP
  // Precisions: bf16 ~2 bytes/param; fp8 ~1 + scales + bf16 embeddings; 4-bit about half of fp8.
  const auto& w = m->weight_bytes;
  EXPECT_NEAR(w[0] / m->total_params, 2.0, 1e-9);
  EXPECT_GT(w[1], m->total_params);
  EXPECT_LT(w[1], 1.01 * m->total_params);
  EXPECT_LT(w[3], w[1]);
  EXPECT_GT(w[2], w[3]);  // mxfp4: 1 byte per 32 values; int4: 2 bytes per 128
}

TEST(ModelSize, DeepSeekV3CatalogEntryMatchesItsConfig) {
  ModelSize v3 = catalog_model("deepseek-v3");
  EXPECT_NEAR(v3.total_params / 671e9, 1.0, 0.01);
  EXPECT_DOUBLE_EQ(v3.kv_bytes_per_token_per_gpu(1, 2), 70272);
  ModelSize k2 = catalog_model("Kimi K2");
  EXPECT_NEAR(k2.total_params / 1e12, 1.0, 0.05);
  EXPECT_NEAR(k2.active_params / 32e9, 1.0, 0.05);
}

// Kimi Linear is sized from its config like any HF directory: the latent cache holds its 7 MLA
// layers, and each request keeps 20 KDA layers' conv inputs and fp32 state.
TEST(ModelSize, KimiLinearCatalogEntryCountsMlaLayersAndState) {
  ModelSize kl = catalog_model("kimi-linear");
  EXPECT_NEAR(kl.total_params / 49e9, 1.0, 0.02);
  EXPECT_NEAR(kl.active_params / 3e9, 1.0, 0.2);
  EXPECT_EQ(kl.kv_layers, 7);
  EXPECT_DOUBLE_EQ(kl.kv_bytes_per_token_per_gpu(1, 2), 7 * 576 * 2);
  EXPECT_DOUBLE_EQ(kl.state_bytes_per_request, 20.0 * (3 * 3 * 4096 + 32 * 128 * 128) * 4);
  EXPECT_TRUE(kl.state_split_by_tp);
}

TEST(ModelSize, QuantizedMatrixBytes) {
  EXPECT_DOUBLE_EQ(matrix_bytes(256, 256, Precision::bf16), 2 * 65536);
  EXPECT_DOUBLE_EQ(matrix_bytes(256, 256, Precision::fp8), 65536 + 4 * 4);
  EXPECT_DOUBLE_EQ(matrix_bytes(129, 256, Precision::fp8), 129 * 256 + 4 * 2 * 2);  // ceil blocks
  EXPECT_DOUBLE_EQ(matrix_bytes(256, 256, Precision::mxfp4), 32768 + 256 * 8);
  EXPECT_DOUBLE_EQ(matrix_bytes(256, 256, Precision::int4), 32768 + 256 * 2 * 2);
}

TEST(ModelSize, GqaEntrySplitsKvHeadsAcrossRanks) {
  json catalog = json::parse(R"({"models": [{"id": "gqa-test", "attention": "gqa", "total_params": 8e9,
    "active_params": 8e9, "bf16_params": 1e9, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "kv_layers": 32}]})");
  auto models = parse_model_catalog(catalog, "test");
  ASSERT_TRUE(models.ok()) << models.error().message;
  const ModelSize& m = (*models)[0];
  EXPECT_DOUBLE_EQ(m.kv_bytes_per_token_per_gpu(1, 2), 32.0 * 2 * 8 * 128 * 2);
  EXPECT_DOUBLE_EQ(m.kv_bytes_per_token_per_gpu(4, 2), 32.0 * 2 * 2 * 128 * 2);
  EXPECT_DOUBLE_EQ(m.kv_bytes_per_token_per_gpu(16, 2), 32.0 * 2 * 1 * 128 * 2);  // one kv head per rank
}

TEST(Measured, SeedTable) {
  struct Case {
    const char* gpu;
    int64_t gpus;
    double tps, price, per_dollar;
    long rounded;
  };
  for (const Case& c : {Case{"MI355X", 8, 952, 2.50, 47.6, 48}, Case{"B200", 16, 498, 4.25, 7.32, 7},
                        Case{"B300", 8, 1568, 6.00, 32.67, 33}}) {
    auto r = measured_row({.hardware = c.gpu, .gpus = c.gpus, .price_per_gpu_hour = c.price, .per_stream_tps = 50,
                           .aggregate_tps = c.tps});
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_NEAR(r->tps_per_gpu_hour_dollar, c.per_dollar, 0.01) << c.gpu;
    EXPECT_EQ(std::lround(r->tps_per_gpu_hour_dollar), c.rounded) << c.gpu;
    EXPECT_NEAR(r->usd_per_mtok, 1e6 / 3600 / r->tps_per_gpu_hour_dollar, 1e-9);
  }
}

TEST(Measured, FromBenchJson) {
  json records = json::parse(R"([
    {"concurrency": 1, "output_tps": 60.0, "per_stream_tps": 61.0},
    {"concurrency": 64, "output_tps": 952.0, "per_stream_tps": 16.0},
    {"concurrency": 128, "output_tps": 900.0, "per_stream_tps": 7.5}])");
  auto s = setup_from_bench_json(records, "bench.json", "MI355X", 8, 2.5);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_DOUBLE_EQ(s->aggregate_tps, 952);
  EXPECT_EQ(s->peak_concurrency, 64);
  EXPECT_DOUBLE_EQ(s->per_stream_tps, 61);
  EXPECT_EQ(std::lround(measured_row(*s)->tps_per_gpu_hour_dollar), 48);
  auto missing = setup_from_bench_json(records, "bench.json", "MI355X", 0, 2.5);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("--gpus"), std::string::npos);
  auto bad = setup_from_bench_json(json::parse(R"([{"concurrency": 1}])"), "b.json", "x", 8, 2.5);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("output_tps"), std::string::npos);
}

TEST(Errors, UnknownGpuListsTheKnownOnes) {
  auto r = select_hardware(hardware(), "b200,tpu9");
  ASSERT_FALSE(r.ok());
  const std::string& e = r.error().message;
  EXPECT_NE(e.find("'tpu9'"), std::string::npos) << e;
  for (const char* id : {"h100", "b300", "mi355x"}) EXPECT_NE(e.find(id), std::string::npos) << e;
}

TEST(Errors, NegativePriceContextZeroAndOtherFlags) {
  auto hw = hardware();
  ModelSize k3 = catalog_model("kimi-k3");
  PlanOptions o;
  o.context = 0;
  auto e = make_plan(k3, hw, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("--context"), std::string::npos) << e.error().message;
  o.context = 1000;
  o.prices["b200"] = -1;
  e = make_plan(k3, hw, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("--price"), std::string::npos) << e.error().message;
  o.prices = {{"tpu9", 1.0}};
  e = make_plan(k3, hw, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("unknown GPU"), std::string::npos) << e.error().message;
  o.prices.clear();
  o.headroom = 1.5;
  EXPECT_NE(make_plan(k3, hw, o).error().message.find("--headroom"), std::string::npos);
  o.headroom = 0.1;
  o.efficiency = 0;
  EXPECT_NE(make_plan(k3, hw, o).error().message.find("--efficiency"), std::string::npos);
  o.efficiency = 0.6;
  o.kv_dtype = "int3";
  EXPECT_NE(make_plan(k3, hw, o).error().message.find("--kv-dtype"), std::string::npos);
  EXPECT_NE(parse_precision("fp6").error().message.find("--precision"), std::string::npos);
  auto m = measured_row({.hardware = "B200", .gpus = 16, .price_per_gpu_hour = -4.25, .aggregate_tps = 498});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("--price-per-gpu-hour"), std::string::npos);
}

TEST(Errors, ConfigMissingFieldsNamesTheField) {
  json config = json::parse(kDeepSeekV3Config);
  config.erase("hidden_size");
  auto dir = write_config("missing", config.dump());
  auto m = resolve_model({}, dir.string());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("hidden_size"), std::string::npos) << m.error().message;
  auto unknown = resolve_model({catalog_model("kimi-k3")}, "no-such-model");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.error().message.find("kimi-k3"), std::string::npos) << unknown.error().message;
  auto entry = parse_model_catalog(json::parse(R"({"models": [{"id": "x", "total_params": 1e9}]})"), "m.json");
  ASSERT_FALSE(entry.ok());
  EXPECT_NE(entry.error().message.find("active_params"), std::string::npos) << entry.error().message;
  auto gpu = parse_hardware_catalog(json::parse(R"({"gpus": [{"id": "x", "hbm_gb": -1}]})"), "h.json");
  ASSERT_FALSE(gpu.ok());
  EXPECT_NE(gpu.error().message.find("hbm_gb"), std::string::npos) << gpu.error().message;
}

TEST(Json, RowsCarryTheDocumentedSchema) {
  Plan plan = k3_plan("b200,b300");
  json j = plan_to_json(plan.rows);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 10u);  // 2 GPUs x TP 1, 2, 4, 8, 16
  for (const json& r : j) {
    for (const char* f : {"hardware", "gpus", "nodes", "tp", "heads_per_rank", "attention_pad_to",
                          "weights_gb_per_gpu", "kv_bytes_per_token", "state_snapshots", "snapshot_gb_per_gpu",
                          "max_kv_tokens", "fits",
                          "decode_tps_per_stream_est", "usd_per_mtok_est"})
      EXPECT_TRUE(r.contains(f)) << f;
    EXPECT_TRUE(r["fits"].is_boolean());
    EXPECT_TRUE(r["gpus"].is_number_integer());
    EXPECT_TRUE(r["attention_pad_to"].is_null() || r["attention_pad_to"].is_number_integer());
    if (r["fits"].get<bool>()) EXPECT_TRUE(r["usd_per_mtok_est"].is_number());
    else EXPECT_TRUE(r["decode_tps_per_stream_est"].is_null());
  }
}

// Hybrids' prefix-cache state snapshots, counted as Engine::create counts them.

Plan hybrid_plan(const std::string& model, const std::string& gpus, int64_t context, int64_t concurrency,
                 std::optional<int64_t> snapshots = std::nullopt) {
  PlanOptions o;
  o.context = context;
  o.concurrency = concurrency;
  o.prefix_state_snapshots = snapshots;
  auto hw = select_hardware(hardware(), gpus);
  EXPECT_TRUE(hw.ok()) << hw.error().message;
  auto plan = make_plan(catalog_model(model), *hw, o);
  EXPECT_TRUE(plan.ok()) << plan.error().message;
  return *plan;
}

// One request's state on one GPU of a TP group (KDA heads split across ranks).
double state_per_gpu(const Plan& plan, const PlanRow& r) { return plan.model.state_bytes_per_request / r.tp; }

double free_bytes(const PlanRow& r) { return r.free_gb_per_gpu * 1e9; }

TEST(Snapshots, DefaultCountIsTheEngineRuleOnKimiLinearAndK3) {
  for (const auto& [model, context, concurrency] :
       {std::tuple<const char*, int64_t, int64_t>{"kimi-linear", 8192, 4}, {"kimi-linear", 1 << 20, 64},
        {"kimi-k3", 1 << 20, 1}, {"kimi-k3", 131072, 16}}) {
    Plan plan = hybrid_plan(model, "h100,b200,b300", context, concurrency);
    for (const PlanRow& r : plan.rows) {
      if (r.heads_per_rank == 0) continue;  // a TP degree the model's heads do not divide by
      SCOPED_TRACE(fmt::format("{} {} TP{} context {} x {}", model, r.hardware, r.tp, context, concurrency));
      const double per_state = state_per_gpu(plan, r);
      const int64_t leftover = static_cast<int64_t>(std::floor(free_bytes(r) - r.kv_gb_per_gpu * 1e9));
      // The engine's rule, spelled out: 2 x max_num_seqs, at most a quarter of what is left.
      const int64_t expected =
          std::min<int64_t>(2 * concurrency, std::max<int64_t>(0, leftover / 4 / std::llround(per_state)));
      EXPECT_EQ(r.state_snapshots, expected);
      EXPECT_EQ(r.state_snapshots, default_state_snapshots(concurrency, std::llround(per_state), leftover));
      EXPECT_NEAR(r.snapshot_gb_per_gpu * 1e9, r.state_snapshots * per_state, 1e-3);
    }
  }
  // With room to spare the count is the full 2 x concurrency, each a per-GPU share of a state.
  Plan roomy = hybrid_plan("kimi-linear", "b300", 8192, 4);
  const PlanRow& r = row(roomy, "b300", 2);
  EXPECT_EQ(r.state_snapshots, 8);
  EXPECT_DOUBLE_EQ(r.snapshot_gb_per_gpu * 1e9, 8 * roomy.model.state_bytes_per_request / 2);
}

TEST(Snapshots, DefaultCountIsCappedAtAQuarterOfTheMemoryLeft) {
  // Pick a context that leaves 22 states' worth of memory beside the KV of 8 requests: a quarter
  // of it is 5.5 states, so 5 snapshots, not 2 x 8 = 16.
  const int64_t concurrency = 8;
  Plan probe = hybrid_plan("kimi-linear", "b300", 4096, concurrency);
  const PlanRow& p = row(probe, "b300", 1);
  const double per_state = state_per_gpu(probe, p);
  const int64_t context =
      static_cast<int64_t>(std::floor((free_bytes(p) - 22 * per_state) / (p.kv_bytes_per_token * concurrency)));
  Plan plan = hybrid_plan("kimi-linear", "b300", context, concurrency);
  const PlanRow& r = row(plan, "b300", 1);
  EXPECT_TRUE(r.fits) << r.why_not;
  EXPECT_EQ(r.state_snapshots, 5);
  // Snapshots are a cache: when the KV itself does not fit there are none, and the reason is the KV.
  Plan tight = hybrid_plan("kimi-linear", "b300", context + 64, concurrency * 2);
  const PlanRow& t = row(tight, "b300", 1);
  EXPECT_FALSE(t.fits);
  EXPECT_EQ(t.state_snapshots, 0);
  EXPECT_EQ(t.why_not.find("snapshot"), std::string::npos) << t.why_not;
}

TEST(Snapshots, MaxKvTokensLeavesExactlyTheSnapshotsBytes) {
  Plan plan = hybrid_plan("kimi-k3", "b300", 131072, 4);
  Plan none = hybrid_plan("kimi-k3", "b300", 131072, 4, 0);
  for (int64_t tp : {8, 16}) {
    const PlanRow& r = row(plan, "b300", tp);
    const PlanRow& n = row(none, "b300", tp);
    ASSERT_EQ(r.state_snapshots, 8) << "TP" << tp;
    EXPECT_EQ(n.state_snapshots, 0);
    EXPECT_DOUBLE_EQ(n.snapshot_gb_per_gpu, 0);
    const double snapshot_bytes = 8 * state_per_gpu(plan, r);
    EXPECT_EQ(n.max_kv_tokens, static_cast<int64_t>(std::floor(free_bytes(n) / n.kv_bytes_per_token)));
    EXPECT_EQ(r.max_kv_tokens,
              static_cast<int64_t>(std::floor((free_bytes(r) - snapshot_bytes) / r.kv_bytes_per_token)));
    EXPECT_LT(r.max_kv_tokens, n.max_kv_tokens);
    EXPECT_DOUBLE_EQ(r.free_gb_per_gpu, n.free_gb_per_gpu);  // free is before the KV pool and the snapshots
  }
}

TEST(Snapshots, AnExplicitCountMustFitOrTheLayoutDoesNot) {
  Plan fits = hybrid_plan("kimi-linear", "h200", 8192, 4, 100);
  const PlanRow& f = row(fits, "h200", 1);
  EXPECT_TRUE(f.fits) << f.why_not;
  EXPECT_EQ(f.state_snapshots, 100);  // more than the default's 8: the option is taken as given
  EXPECT_NEAR(f.snapshot_gb_per_gpu * 1e9, 100 * fits.model.state_bytes_per_request, 1e-3);
  // More snapshots than the memory the KV at context leaves: no fit, and the reason names them.
  const int64_t too_many = static_cast<int64_t>(f.free_gb_per_gpu * 1e9 / fits.model.state_bytes_per_request);
  Plan over = hybrid_plan("kimi-linear", "h200", 8192, 4, too_many);
  const PlanRow& o = row(over, "h200", 1);
  EXPECT_FALSE(o.fits);
  EXPECT_FALSE(o.decode_tps_per_stream_est);
  EXPECT_NE(o.why_not.find("snapshots"), std::string::npos) << o.why_not;
  EXPECT_NE(o.why_not.find("--prefix-state-snapshots"), std::string::npos) << o.why_not;
  EXPECT_LT(o.max_kv_tokens, 8192 * 4);
}

TEST(Snapshots, NegativeCountIsRefusedNamingTheFlag) {
  PlanOptions o;
  o.context = 4096;
  o.prefix_state_snapshots = -1;
  auto plan = make_plan(catalog_model("kimi-linear"), hardware(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.error().message.find("--prefix-state-snapshots"), std::string::npos) << plan.error().message;
}

// DeepSeek has no recurrent state: no snapshots, whatever the option says, and the same KV pool.
TEST(Snapshots, DeepSeekRowsAreUnchanged) {
  for (std::optional<int64_t> snapshots : {std::optional<int64_t>(), std::optional<int64_t>(50)}) {
    Plan plan = hybrid_plan("deepseek-v3", "h200,b300", 32768, 8, snapshots);
    for (const PlanRow& r : plan.rows) {
      EXPECT_EQ(r.state_snapshots, 0) << r.hardware << " TP" << r.tp;
      EXPECT_DOUBLE_EQ(r.snapshot_gb_per_gpu, 0);
      if (r.free_gb_per_gpu > 0) {
        EXPECT_EQ(r.max_kv_tokens, static_cast<int64_t>(std::floor(free_bytes(r) / r.kv_bytes_per_token)));
      }
    }
  }
}

std::string printed(const Plan& plan) {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&text, &size);
  print_plan(out, plan, plan.rows, true);
  std::fclose(out);
  std::string s(text, size);
  std::free(text);
  return s;
}

TEST(Snapshots, TableShowsThemForHybridsOnlyAndJsonAlways) {
  Plan hybrid = hybrid_plan("kimi-linear", "b300", 8192, 4);
  const std::string h = printed(hybrid);
  EXPECT_NE(h.find("snapshots/GPU"), std::string::npos) << h;
  EXPECT_NE(h.find("Prefix-cache state snapshots: the engine's default"), std::string::npos) << h;
  EXPECT_NE(h.find("8 = 359.1 MB"), std::string::npos) << h;  // TP1: 8 x 44.9 MB
  const std::string d = printed(hybrid_plan("deepseek-v3", "b300", 8192, 4));
  EXPECT_EQ(d.find("snapshot"), std::string::npos) << d;
  for (const json& r : plan_to_json(hybrid.rows)) {
    EXPECT_TRUE(r["state_snapshots"].is_number_integer());
    EXPECT_TRUE(r["snapshot_gb_per_gpu"].is_number());
  }
  const json j = row_to_json(row(hybrid, "b300", 1));
  EXPECT_EQ(j["state_snapshots"], 8);
  EXPECT_DOUBLE_EQ(j["snapshot_gb_per_gpu"].get<double>(), 8 * hybrid.model.state_bytes_per_request / 1e9);
}

TEST(Chart, WritesPngAndSvg) {
  Plan plan = k3_plan("b200,b300,mi355x");
  auto rows = smallest_fitting(plan.rows);
  for (const char* name : {"moat_plan_chart.png", "moat_plan_chart.svg"}) {
    auto path = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove(path);
    Status s = draw_memory_chart(path.string(), rows, "Kimi K3");
    ASSERT_TRUE(s.ok()) << s.error().message;
    EXPECT_GT(std::filesystem::file_size(path), 1000u) << name;
  }
  EXPECT_FALSE(draw_memory_chart("/tmp/chart.gif", rows, "x").ok());
}

}  // namespace
}  // namespace moat::plan

namespace moat::plan {
namespace {

TEST(Chart, ShowsTheOneNodeLayoutNextToAMultiNodeFit) {
  Plan plan = k3_plan("b200,b300");
  auto rows = chart_rows(plan.rows, hardware());
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].hardware, "b200");
  EXPECT_EQ(rows[0].gpus, 8);
  EXPECT_FALSE(rows[0].fits);
  EXPECT_EQ(rows[1].gpus, 16);
  EXPECT_TRUE(rows[1].fits);
  EXPECT_EQ(rows[2].hardware, "b300");
}

}  // namespace
}  // namespace moat::plan
