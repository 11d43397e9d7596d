// The weight spec (models/weight_spec.h) against the tensors it describes: names and shapes of
// the DeepSeek-V3 table, layer kinds and TP splits, validation messages (moved here from
// tests/loader with the table), the golden checkpoints holding exactly the spec's tensors, the
// model's active-weight counts, and the architecture registry.
#include <gtest/gtest.h>

#include <filesystem>

#include "config/model_config.h"

#include <map>
#include <optional>
#include <set>

#include "../loader/test_files.h"
#include "loader/checkpoint.h"
#include "loader/weight_map.h"
#include "models/deepseek_v3.h"
#include "models/registry.h"
#include "models/weight_spec.h"

namespace moat {
namespace {

using namespace testing_files;

// Every tensor of the spec (bf16, or fp8 + scales for quantizable matrices) plus one MTP layer.
std::vector<TensorToWrite> model_tensors(const ModelConfig& c, bool fp8) {
  std::vector<TensorToWrite> out;
  int seed = 0;
  for (const TensorSpec& e : deepseek_v3_weight_spec(c).tensors) {
    if (fp8 && e.storage == TensorStorage::matrix) {
      const int64_t n = e.shape[0] * e.shape[1];
      out.push_back({e.name, DType::F8_E4M3, e.shape, std::vector<uint8_t>(n, 0x38)});
      const int64_t so = (e.shape[0] + 127) / 128, si = (e.shape[1] + 127) / 128;
      out.push_back({e.name + "_scale_inv", DType::F32, {so, si},
                     f32_bytes(std::vector<float>(so * si, 0.5f))});
    } else {
      out.push_back(bf16_tensor(e.name, e.shape, seed++));
    }
  }
  // MTP layer (index == num_hidden_layers): present in real checkpoints, ignored by moat.
  out.push_back(bf16_tensor("model.layers.2.eh_proj.weight", {16, 32}));
  out.push_back(bf16_tensor("model.layers.2.input_layernorm.weight", {16}));
  return out;
}

// Writes the model split over two shards with an index.
void write_sharded(const fs::path& dir, std::vector<TensorToWrite> tensors) {
  const size_t half = tensors.size() / 2;
  std::vector<TensorToWrite> s1(tensors.begin(), tensors.begin() + half);
  std::vector<TensorToWrite> s2(tensors.begin() + half, tensors.end());
  ASSERT_TRUE(write_safetensors(dir / "model-00001-of-00002.safetensors", s1).ok());
  ASSERT_TRUE(write_safetensors(dir / "model-00002-of-00002.safetensors", s2).ok());
  json wm = json::object();
  for (const auto& t : s1) wm[t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : s2) wm[t.name] = "model-00002-of-00002.safetensors";
  write_index(dir, wm);
}

TEST(WeightSpec, NamesAndShapes) {
  ModelConfig c = tiny_config();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : deepseek_v3_weight_spec(c).tensors) shapes[e.name] = e.shape;
  using S = std::vector<int64_t>;
  EXPECT_EQ(shapes.at("model.embed_tokens.weight"), S({32, 16}));
  EXPECT_EQ(shapes.at("lm_head.weight"), S({32, 16}));
  EXPECT_EQ(shapes.at("model.norm.weight"), S({16}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_a_proj.weight"), S({12, 16}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_a_layernorm.weight"), S({12}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_b_proj.weight"), S({2 * 6, 12}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), S({8 + 2, 16}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.kv_a_layernorm.weight"), S({8}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.kv_b_proj.weight"), S({2 * (4 + 4), 8}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.weight"), S({16, 2 * 4}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.gate_proj.weight"), S({24, 16}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), S({16, 24}));
  EXPECT_EQ(shapes.count("model.layers.0.mlp.gate.weight"), 0u);
  EXPECT_EQ(shapes.at("model.layers.1.mlp.gate.weight"), S({4, 16}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.gate.e_score_correction_bias"), S({4}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.experts.3.up_proj.weight"), S({8, 16}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.experts.3.down_proj.weight"), S({16, 8}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.shared_experts.gate_proj.weight"), S({8, 16}));
  EXPECT_EQ(shapes.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.2.input_layernorm.weight"), 0u);  // MTP: not expected

  ModelConfig no_q_lora = tiny_config(false, /*q_lora=*/false);
  no_q_lora.tie_word_embeddings = true;
  no_q_lora.topk_method = "greedy";
  std::map<std::string, std::vector<int64_t>> s2;
  for (const auto& e : deepseek_v3_weight_spec(no_q_lora).tensors) s2[e.name] = e.shape;
  EXPECT_EQ(s2.at("model.layers.0.self_attn.q_proj.weight"), S({12, 16}));
  EXPECT_EQ(s2.count("model.layers.0.self_attn.q_a_proj.weight"), 0u);
  EXPECT_EQ(s2.count("lm_head.weight"), 0u);
  EXPECT_EQ(s2.count("model.layers.1.mlp.gate.e_score_correction_bias"), 0u);
}

TEST(WeightSpec, ShardedBf16CheckpointValidates) {
  TempDir dir;
  ModelConfig c = tiny_config();
  write_sharded(dir.path(), model_tensors(c, false));
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto s = validate_checkpoint(*ckpt, deepseek_v3_weight_spec(c));
  EXPECT_TRUE(s.ok()) << s.error().message;
}

TEST(WeightSpec, Fp8CheckpointValidates) {
  TempDir dir;
  ModelConfig c = tiny_config(/*fp8=*/true);
  write_sharded(dir.path(), model_tensors(c, true));
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto s = validate_checkpoint(*ckpt, deepseek_v3_weight_spec(c));
  EXPECT_TRUE(s.ok()) << s.error().message;
  auto w = get_matrix(*ckpt, "model.layers.1.mlp.experts.2.down_proj.weight", 16, 8, c);
  ASSERT_TRUE(w.ok()) << w.error().message;
  EXPECT_EQ(w->at(15, 7), 1.0f * 0.5f);  // code 0x38 is 1.0, scale 0.5
}

// Replaces (or drops, when `replacement` is null) one tensor of the tiny model and returns the
// validation error.
std::string validate_with(const std::string& name, std::optional<TensorToWrite> replacement,
                          bool fp8 = false) {
  TempDir dir;
  ModelConfig c = tiny_config(fp8);
  auto tensors = model_tensors(c, fp8);
  std::vector<TensorToWrite> edited;
  for (auto& t : tensors) {
    if (t.name != name) {
      edited.push_back(std::move(t));
    } else if (replacement) {
      edited.push_back(*replacement);
    }
  }
  write_sharded(dir.path(), edited);
  auto ckpt = Checkpoint::open(dir.path());
  if (!ckpt.ok()) return "open failed: " + ckpt.error().message;
  auto s = validate_checkpoint(*ckpt, deepseek_v3_weight_spec(c));
  return s.ok() ? std::string("(valid)") : s.error().message;
}

TEST(WeightSpecErrors, MissingTensor) {
  std::string e = validate_with("model.layers.1.mlp.experts.2.up_proj.weight", std::nullopt);
  EXPECT_HAS(e, "model.layers.1.mlp.experts.2.up_proj.weight: missing from the checkpoint "
                "(expected shape [8, 16])");
  e = validate_with("model.layers.1.mlp.gate.e_score_correction_bias", std::nullopt);
  EXPECT_HAS(e, "model.layers.1.mlp.gate.e_score_correction_bias: missing");
}

TEST(WeightSpecErrors, WrongShapeNamesTheShard) {
  const std::string name = "model.layers.1.self_attn.kv_b_proj.weight";
  std::string e = validate_with(name, bf16_tensor(name, {16, 4}));
  EXPECT_HAS(e, name + ": expected shape [16, 8], got [16, 4] (in model-0000");
  EXPECT_HAS(e, "-of-00002.safetensors)");
}

TEST(WeightSpecErrors, WrongDtype) {
  const std::string norm = "model.layers.0.input_layernorm.weight";
  std::string e = validate_with(norm, TensorToWrite{norm, DType::I32, {16},
                                                    std::vector<uint8_t>(64, 0)});
  EXPECT_HAS(e, norm + ": expected dtype BF16, F16 or F32, got I32");
  // fp8 is refused where checkpoints never quantize (embeddings, router), even in fp8 models.
  const std::string gate = "model.layers.1.mlp.gate.weight";
  e = validate_with(gate, TensorToWrite{gate, DType::F8_E4M3, {4, 16},
                                        std::vector<uint8_t>(64, 0x38)},
                    /*fp8=*/true);
  EXPECT_HAS(e, gate + ": expected dtype BF16, F16 or F32, got F8_E4M3");
  // And everywhere in a checkpoint whose config has no quantization_config.
  const std::string o = "model.layers.0.self_attn.o_proj.weight";
  e = validate_with(o, TensorToWrite{o, DType::F8_E4M3, {16, 8}, std::vector<uint8_t>(128, 0)});
  EXPECT_HAS(e, o + ": dtype F8_E4M3, but config.json has no quantization_config");
}

TEST(WeightSpecErrors, Fp8ScaleMissingOrWrongDtype) {
  const std::string w = "model.layers.0.mlp.up_proj.weight";
  std::string e = validate_with(w + "_scale_inv", std::nullopt, /*fp8=*/true);
  EXPECT_HAS(e, w + "_scale_inv: missing");
  e = validate_with(w + "_scale_inv", bf16_tensor(w + "_scale_inv", {1, 1}), /*fp8=*/true);
  EXPECT_HAS(e, w + "_scale_inv: expected dtype F32, got BF16");
}

// Dropping any one tensor of the spec fails validation naming that tensor: validate_checkpoint
// demands exactly the spec's list (and the full checkpoint, MTP layer included, validates).
TEST(WeightSpec, ValidationDemandsEveryTensorOfTheSpec) {
  const ModelConfig c = tiny_config();
  const WeightSpec spec = deepseek_v3_weight_spec(c);
  EXPECT_EQ(validate_with("(none)", std::nullopt), "(valid)");
  for (const TensorSpec& t : spec.tensors)
    EXPECT_HAS(validate_with(t.name, std::nullopt), t.name + ": missing from the checkpoint");
}

TEST(WeightSpec, LayerKindsPartsRolesAndSplits) {
  const ModelConfig c = tiny_config();
  const WeightSpec spec = deepseek_v3_weight_spec(c);
  ASSERT_EQ(spec.layers.size(), 2u);
  EXPECT_EQ(spec.layers[0].attention, AttentionKind::mla);
  EXPECT_EQ(spec.layers[0].ffn, FfnKind::dense);
  EXPECT_EQ(spec.layers[1].ffn, FfnKind::moe);
  EXPECT_EQ(spec.experts_per_token, 2);
  EXPECT_EQ(spec.routed_experts, 4);

  std::set<std::string> names;
  for (const TensorSpec& t : spec.tensors) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name << " listed twice";
    EXPECT_EQ(t.shape.size(), t.is_matrix() ? 2u : 1u) << t.name;
    EXPECT_EQ(t.expert >= 0, t.part == Part::routed_expert) << t.name;
    EXPECT_EQ(t.layer >= 0, t.part != Part::embedding && t.part != Part::lm_head && t.part != Part::final_norm)
        << t.name;
    EXPECT_EQ(t.split == TpSplit::expert, t.part == Part::routed_expert) << t.name;
    if (t.split == TpSplit::column) { EXPECT_EQ(t.shape[0] % t.split_unit, 0) << t.name; }
    if (t.split == TpSplit::row) { EXPECT_EQ(t.shape[1] % t.split_unit, 0) << t.name; }
  }
  auto at = [&](const std::string& name) -> const TensorSpec& {
    const TensorSpec* t = spec.find(name);
    EXPECT_NE(t, nullptr) << name;
    return *t;
  };
  const TensorSpec& embed = at("model.embed_tokens.weight");
  EXPECT_EQ(embed.part, Part::embedding);
  EXPECT_EQ(embed.storage, TensorStorage::matrix_no_quant);
  EXPECT_EQ(embed.split, TpSplit::vocab);
  EXPECT_EQ(at("lm_head.weight").split, TpSplit::vocab);
  EXPECT_EQ(at("model.norm.weight").part, Part::final_norm);
  const TensorSpec& q_b = at("model.layers.0.self_attn.q_b_proj.weight");
  EXPECT_EQ(q_b.role, Role::q_b_proj);
  EXPECT_EQ(q_b.split, TpSplit::column);
  EXPECT_EQ(q_b.split_unit, 6);  // one head: nope + rope
  EXPECT_EQ(at("model.layers.0.self_attn.kv_b_proj.weight").split_unit, 8);  // nope + v
  const TensorSpec& o = at("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o.split, TpSplit::row);
  EXPECT_EQ(o.split_unit, 4);  // v
  EXPECT_EQ(at("model.layers.0.self_attn.q_a_proj.weight").split, TpSplit::replicated);
  EXPECT_EQ(at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").split, TpSplit::replicated);
  EXPECT_EQ(at("model.layers.0.mlp.gate_proj.weight").part, Part::dense_mlp);
  EXPECT_EQ(at("model.layers.0.mlp.gate_proj.weight").split, TpSplit::column);
  EXPECT_EQ(at("model.layers.0.mlp.down_proj.weight").split, TpSplit::row);
  const TensorSpec& router = at("model.layers.1.mlp.gate.weight");
  EXPECT_EQ(router.part, Part::router);
  EXPECT_EQ(router.storage, TensorStorage::matrix_no_quant);
  EXPECT_EQ(router.split, TpSplit::replicated);
  EXPECT_EQ(at("model.layers.1.mlp.gate.e_score_correction_bias").role, Role::score_bias);
  const TensorSpec& e3 = at("model.layers.1.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(e3.part, Part::routed_expert);
  EXPECT_EQ(e3.expert, 3);
  EXPECT_EQ(e3.role, Role::down_proj);
  EXPECT_FALSE(spec.read_per_token(e3));  // stands for the experts a token is not sent to
  EXPECT_TRUE(spec.read_per_token(at("model.layers.1.mlp.experts.1.down_proj.weight")));
  EXPECT_EQ(at("model.layers.1.mlp.shared_experts.up_proj.weight").part, Part::shared_experts);
  EXPECT_EQ(at("model.layers.1.mlp.shared_experts.up_proj.weight").split, TpSplit::column);
}

// MTP layers are stored after the main ones; the spec leaves them out.
bool is_mtp(const std::string& name, int64_t num_layers) {
  const std::string p = "model.layers.";
  if (name.rfind(p, 0) != 0) return false;
  return std::stoll(name.substr(p.size())) >= num_layers;
}

// Every model and golden fixture: each checkpoint tensor outside the MTP layers (fp8 scales
// aside) is in the spec exactly once and each spec tensor is in the checkpoint; the spec's
// parameter count is the checkpoint's, and the model built from it loads.
TEST(WeightSpec, GoldenCheckpointsHoldExactlyTheSpecsTensors) {
  const fs::path root = MOAT_SOURCE_DIR;
  int checked = 0;
  for (const fs::path& dir : {root / "tests/golden/tiny_qlora", root / "tests/golden/tiny_v2lite",
                             root / "tests/golden/tiny_fp8", root / "tests/golden/tiny_kimi_linear", root / "models/k3-nano",
                             root / "models/k3-nano-draft"}) {
    if (!fs::exists(dir / "config.json")) continue;
    SCOPED_TRACE(dir.string());
    auto config = load_model_config(dir);
    ASSERT_TRUE(config.ok()) << config.error().message;
    auto spec = weight_spec_for(*config);
    ASSERT_TRUE(spec.ok()) << spec.error().message;
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
    auto valid = validate_checkpoint(*ckpt, *spec);
    EXPECT_TRUE(valid.ok()) << valid.error().message;

    std::map<std::string, int> in_spec;
    int64_t spec_params = 0;
    for (const TensorSpec& t : spec->tensors) {
      ++in_spec[t.name];
      spec_params += t.numel();
    }
    int64_t ckpt_params = 0, ckpt_tensors = 0;
    for (const std::string& name : ckpt->names()) {
      if (is_mtp(name, config->num_hidden_layers)) continue;
      if (name.size() > 10 && name.ends_with("_scale_inv")) {
        EXPECT_TRUE(in_spec.count(name.substr(0, name.size() - 10))) << name << ": scales of no spec tensor";
        continue;
      }
      // 4-bit experts (compressed-tensors): the spec's "w.weight" is stored as w.weight_packed
      // (two values a byte) + w.weight_scale (one per 32 values).
      if (name.ends_with(".weight_scale")) {
        EXPECT_TRUE(in_spec.count(name.substr(0, name.size() - 6))) << name << ": scales of no spec tensor";
        continue;
      }
      if (name.ends_with(".weight_packed")) {
        const std::string weight = name.substr(0, name.size() - 7);
        EXPECT_EQ(in_spec[weight], 1) << name;
        ckpt_params += ckpt->find(name)->numel() * 2;
        ++ckpt_tensors;
        continue;
      }
      EXPECT_EQ(in_spec[name], 1) << name;
      ckpt_params += ckpt->find(name)->numel();
      ++ckpt_tensors;
    }
    EXPECT_EQ(ckpt_tensors, static_cast<int64_t>(spec->tensors.size()));
    EXPECT_EQ(spec_params, ckpt_params);
    ++checked;
  }
  EXPECT_GE(checked, 4) << "the committed fixtures are missing";
}

// Kimi K3's text model: every tensor of its table is in the fixture (MXFP4 experts as
// weight_packed + weight_scale), and the checkpoint holds nothing else.
TEST(WeightSpec, KimiK3FixtureHoldsExactlyTheSpecsTensors) {
  const fs::path dir = fs::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_k3";
  auto config = load_model_config(dir);
  ASSERT_TRUE(config.ok()) << config.error().message;
  auto spec = weight_spec_for(*config);
  ASSERT_TRUE(spec.ok()) << spec.error().message;
  auto ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto valid = validate_checkpoint(*ckpt, *spec);
  EXPECT_TRUE(valid.ok()) << valid.error().message;
  std::set<std::string> expected;
  for (const TensorSpec& t : spec->tensors) {
    if (ckpt->find(t.name)) {
      expected.insert(t.name);
    } else {
      const std::string stem = t.name.substr(0, t.name.size() - 6);  // "...w1." of "...w1.weight"
      EXPECT_EQ(t.part, Part::routed_expert) << t.name;
      expected.insert(stem + "weight_packed");
      expected.insert(stem + "weight_scale");
    }
  }
  const std::vector<std::string> names = ckpt->names();
  const std::set<std::string> present(names.begin(), names.end());
  EXPECT_EQ(present, expected);
}

// The active-weight counts walk the spec now; these are the numbers the previous implementation
// (which walked the loaded layers) gave, so the rooflines of bench/ did not move.
TEST(WeightSpec, ActiveWeightCountsUnchanged) {
  struct Case {
    const char* dir;
    bool exact;
    int64_t bytes, params;
    double step4;
  };
  const fs::path root = MOAT_SOURCE_DIR;
  // models/k3-nano (K3-shaped, MXFP4 experts): a count over its safetensors header (2-D tensors;
  // one embedding row; 4 of 16 experts per MoE layer at their packed + scale bytes) gives 4,608
  // bytes more: the 9 AttnRes projections [1, 256], which the model treats as vectors. step4:
  // 4 x 78,336 expert bytes replaced by 16 (1 - (12/16)^4) = 10.9375 experts' worth.
  for (const Case& k : {Case{"models/k3-nano", false, 8434176, 4649984, 8977632},
                        Case{"tests/golden/tiny_v2lite", false, 1385792, 692736, 1559942},
                        Case{"tests/golden/tiny_fp8", false, 627372, 488448, 691474.5},
                        Case{"tests/golden/tiny_fp8", true, 701100, 488448, 765202.5}}) {
    if (!fs::exists(root / k.dir / "config.json")) continue;
    SCOPED_TRACE(k.dir);
    auto m = DeepseekModel::load(root / k.dir, {.backend = ops::Backend::cpu, .max_context = 64, .exact_activations = k.exact});
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ((*m)->active_weights_per_token().bytes, k.bytes);
    EXPECT_EQ((*m)->active_weights_per_token().params, k.params);
    EXPECT_DOUBLE_EQ((*m)->weight_bytes_per_step(1), static_cast<double>(k.bytes));
    EXPECT_DOUBLE_EQ((*m)->weight_bytes_per_step(4), k.step4);
    EXPECT_EQ((*m)->weight_spec().tensors.size(), weight_spec_for((*m)->config())->tensors.size());
  }
}

// A decode token's roofline (model_bench) divides by active_weights_per_token(); this holds that
// count to what a forward actually streams: the weight bytes an attached ops::OpProfile records for
// one decode token (matmuls, routed experts, per-head matmuls) are the active bytes less the one
// embedding row, which is a lookup. A layer whose weights bypassed the ops, or a count that drifted
// from the forward, fails here.
TEST(WeightSpec, ADecodeTokenStreamsExactlyTheActiveWeights) {
  const fs::path root = MOAT_SOURCE_DIR;
  for (const char* dir : {"models/k3-nano", "tests/golden/tiny_v2lite", "tests/golden/tiny_fp8",
                          "tests/golden/tiny_kimi_linear", "tests/golden/tiny_k3"}) {
    if (!fs::exists(root / dir / "config.json")) continue;
    SCOPED_TRACE(dir);
    auto m = DeepseekModel::load(root / dir, {.backend = ops::Backend::cpu, .max_context = 64});
    ASSERT_TRUE(m.ok()) << m.error().message;
    DeepseekModel& model = **m;
    const ModelConfig& c = model.config();
    auto cache = model.new_sequence_cache(8, 4);
    std::vector<float> logits(static_cast<size_t>(3 * c.vocab_size));
    const std::vector<int32_t> prompt = {1, 5, 9}, next = {7};
    model.forward(cache, prompt, 0, logits.data());
    ops::OpProfile profile;
    model.set_op_profile(&profile);
    model.forward(cache, next, 3, logits.data());
    model.set_op_profile(nullptr);
    const auto& b = profile.buckets;
    const double streamed = b[ops::OpProfile::matmul].weight_bytes + b[ops::OpProfile::routed_experts].weight_bytes +
                            b[ops::OpProfile::head_matmul].weight_bytes;
    const int64_t embedding_row = c.hidden_size * 2;  // bf16 in every one of these checkpoints
    EXPECT_EQ(streamed, static_cast<double>(model.active_weights_per_token().bytes - embedding_row));
    EXPECT_GT(b[ops::OpProfile::matmul].calls, 0);
    EXPECT_EQ(b[ops::OpProfile::routed_experts].calls > 0, c.n_routed_experts > 0);
    EXPECT_GT(b[ops::OpProfile::attention].calls, 0);
    EXPECT_EQ(b[ops::OpProfile::kda].calls > 0, model.state_bytes_per_request() > 0);
    for (const auto& bucket : b) EXPECT_GE(bucket.seconds, 0.0);
    // detached: the next forward adds nothing
    const ops::OpProfile before = profile;
    model.forward(cache, next, 4, logits.data());
    EXPECT_EQ(profile.buckets[ops::OpProfile::matmul].calls, before.buckets[ops::OpProfile::matmul].calls);
  }
}

TEST(Registry, UnknownArchitectureIsRefusedWithTheSupportedList) {
  auto a = find_architecture("LlamaForCausalLM");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.error().message,
            "architecture 'LlamaForCausalLM' is not supported; supported: [DeepseekV3ForCausalLM, "
            "DeepseekV2ForCausalLM, KimiLinearForCausalLM, KimiK3ForConditionalGeneration]");
  ModelConfig c = tiny_config();
  c.architecture = "Qwen3NextForCausalLM";
  auto spec = weight_spec_for(c);
  ASSERT_FALSE(spec.ok());
  EXPECT_HAS(spec.error().message, "'Qwen3NextForCausalLM' is not supported; supported: [DeepseekV3ForCausalLM");
}

// The config loader and the registry must agree on what is supported: the list config.json's
// parser prints for an unknown architecture is the registry's.
TEST(Registry, CoversEveryArchitectureTheConfigLoaderAccepts) {
  auto refused = parse_model_config(json{{"architectures", {"NoSuchForCausalLM"}}});
  ASSERT_FALSE(refused.ok());
  EXPECT_HAS(refused.error().message, "supported: [" + supported_architectures_list() + "]");
  for (const Architecture& a : architectures()) {
    ModelConfig c = tiny_config();
    c.architecture = std::string(a.name);
    auto spec = weight_spec_for(c);
    ASSERT_TRUE(spec.ok()) << a.name;
    EXPECT_EQ(spec->tensors.size(), deepseek_v3_weight_spec(c).tensors.size()) << a.name;  // no KDA layer in c
  }
}

// Kimi Linear's table: KDA or MLA per layer from the 1-based lists, Kimi's tensor names
// (block_sparse_moe, experts w1/w3/w2, conv weights [width, 1, W], A_log [1, 1, H, 1]).
TEST(WeightSpec, KimiLinearLayerKindsNamesAndShapes) {
  ModelConfig c = tiny_config();
  c.architecture = "KimiLinearForCausalLM";
  c.model_type = "kimi_linear";
  c.q_lora_rank.reset();
  c.mla_use_nope = true;
  c.linear_attn = LinearAttentionConfig{.num_heads = 3, .head_dim = 8, .short_conv_kernel_size = 4,
                                        .kda_layers = {1}, .full_attn_layers = {2}};
  const WeightSpec spec = kimi_linear_weight_spec(c);
  ASSERT_EQ(spec.layers.size(), 2u);
  EXPECT_EQ(spec.layers[0].attention, AttentionKind::kda);
  EXPECT_EQ(spec.layers[1].attention, AttentionKind::mla);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& t : spec.tensors) shapes[t.name] = t.shape;
  const int64_t H = c.hidden_size, width = 24;
  const std::map<std::string, std::vector<int64_t>> kda = {
      {"q_proj.weight", {width, H}},       {"k_proj.weight", {width, H}},       {"v_proj.weight", {width, H}},
      {"q_conv1d.weight", {width, 1, 4}},  {"k_conv1d.weight", {width, 1, 4}},  {"v_conv1d.weight", {width, 1, 4}},
      {"f_a_proj.weight", {8, H}},         {"f_b_proj.weight", {width, 8}},     {"A_log", {1, 1, 3, 1}},
      {"dt_bias", {width}},                {"b_proj.weight", {3, H}},           {"g_a_proj.weight", {8, H}},
      {"g_b_proj.weight", {width, 8}},     {"o_norm.weight", {8}},              {"o_proj.weight", {H, width}}};
  for (const auto& [suffix, shape] : kda) {
    const std::string name = "model.layers.0.self_attn." + suffix;
    ASSERT_TRUE(shapes.count(name)) << name;
    EXPECT_EQ(shapes[name], shape) << name;
  }
  EXPECT_FALSE(shapes.count("model.layers.0.self_attn.kv_b_proj.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_FALSE(shapes.count("model.layers.1.self_attn.A_log"));
  // layer 0 dense (first_k_dense_replace 1), layer 1 MoE under block_sparse_moe
  EXPECT_TRUE(shapes.count("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.gate.e_score_correction_bias"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.experts.0.w1.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.experts.0.w3.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.experts.0.w2.weight"));
  EXPECT_TRUE(shapes.count("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"));
  EXPECT_FALSE(shapes.count("model.layers.1.mlp.gate.weight"));
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

// The MTP head's table is exactly the checkpoint's model.layers.{L}.* tensors (fp8 scales aside),
// in the DeepSeek-V3 layout make_checkpoint.py writes; a checkpoint without one is refused by name.
TEST(WeightSpec, MtpHeadSpecIsTheCheckpointsExtraLayer) {
  const fs::path root = MOAT_SOURCE_DIR;
  for (const fs::path& dir : {root / "tests/golden/tiny_qlora", root / "tests/golden/tiny_fp8"}) {
    SCOPED_TRACE(dir.string());
    auto config = load_model_config(dir);
    ASSERT_TRUE(config.ok()) << config.error().message;
    ASSERT_EQ(config->num_nextn_predict_layers, 1);
    auto spec = deepseek_v3_mtp_weight_spec(*config);
    ASSERT_TRUE(spec.ok()) << spec.error().message;
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok());
    auto valid = validate_checkpoint(*ckpt, *spec);
    EXPECT_TRUE(valid.ok()) << valid.error().message;
    std::set<std::string> names;
    for (const TensorSpec& t : spec->tensors) EXPECT_TRUE(names.insert(t.name).second) << t.name << " twice";
    int64_t mtp_tensors = 0;
    for (const std::string& name : ckpt->names()) {
      if (!is_mtp(name, config->num_hidden_layers) || name.ends_with("_scale_inv")) continue;
      EXPECT_TRUE(names.count(name)) << name << " missing from the MTP spec";
      ++mtp_tensors;
    }
    EXPECT_EQ(mtp_tensors, static_cast<int64_t>(spec->tensors.size()));
    ASSERT_EQ(spec->layers.size(), 1u);
    EXPECT_EQ(spec->layers[0].ffn, FfnKind::moe);
  }
  auto plain = load_model_config(root / "tests/golden/tiny_v2lite");
  ASSERT_TRUE(plain.ok());
  auto none = deepseek_v3_mtp_weight_spec(*plain);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("num_nextn_predict_layers"), std::string::npos) << none.error().message;
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

// Expert parallelism puts every routed expert on exactly one rank, contiguous ranges in rank
// order, differing in size by at most one when the ranks do not divide the experts.
TEST(ExpertParallelSplit, EveryExpertOnExactlyOneRankBalancedWithinOne) {
  for (int64_t experts : {8, 16, 64, 256, 384, 7})
    for (int tp : {1, 2, 3, 4, 5, 8, 16}) {
      if (tp > experts) continue;
      int64_t next = 0, smallest = experts, largest = 0;
      for (int rank = 0; rank < tp; ++rank) {
        const auto [first, last] = expert_range_of_rank(experts, tp, rank);
        EXPECT_EQ(first, next) << experts << " experts, tp " << tp << ", rank " << rank;
        next = last;
        smallest = std::min(smallest, last - first);
        largest = std::max(largest, last - first);
      }
      EXPECT_EQ(next, experts) << experts << " experts, tp " << tp;
      EXPECT_LE(largest - smallest, 1) << experts << " experts, tp " << tp;
    }
  const auto [first, last] = expert_range_of_rank(16, 3, 2);
  EXPECT_EQ(last - first, 6);  // 5, 5, 6
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

WeightSpec spec_of(const std::string& dir) {
  auto c = load_model_config(std::filesystem::path(MOAT_SOURCE_DIR) / dir);
  EXPECT_TRUE(c.ok()) << c.error().message;
  auto s = weight_spec_for(*c);
  EXPECT_TRUE(s.ok()) << s.error().message;
  return *s;
}

// moat doctor --tp predicts the load's refusals from the weight table: what splits, and the first
// tensor of each kind that does not, naming why.
TEST(TpSplitProblems, PredictWhatTheLoadRefuses) {
  EXPECT_TRUE(tp_split_problems(spec_of("models/k3-nano"), 2, false).empty());
  EXPECT_TRUE(tp_split_problems(spec_of("models/k3-nano"), 4, true).empty());
  EXPECT_TRUE(tp_split_problems(spec_of("tests/golden/tiny_kimi_linear"), 2, false).empty());
  const auto fp8 = tp_split_problems(spec_of("tests/golden/tiny_fp8"), 2, false);
  ASSERT_FALSE(fp8.empty());
  EXPECT_NE(fp8.front().find("q_b_proj.weight at --tp 2: 192 rows per rank cut through the fp8 scale blocks of 128 rows"),
            std::string::npos)
      << fp8.front();
  for (const std::string& p : fp8) EXPECT_EQ(p.find("experts.1."), std::string::npos) << "one line per kind: " << p;
  const auto k3 = tp_split_problems(spec_of("tests/golden/tiny_k3"), 4, false);
  ASSERT_EQ(k3.size(), 1u);
  EXPECT_NE(k3.front().find("w2.weight at --tp 4: 16 columns per rank cut through the 32-column scale groups of MXFP4"),
            std::string::npos)
      << k3.front();
  EXPECT_TRUE(tp_split_problems(spec_of("tests/golden/tiny_k3"), 4, true).empty());
  // 16 experts over 32 ranks
  EXPECT_FALSE(tp_split_problems(spec_of("models/k3-nano"), 32, true).empty());
  // widths a degree does not divide: k3-nano's moe_intermediate 128 over 3 ranks
  const auto three = tp_split_problems(spec_of("models/k3-nano"), 3, false);
  ASSERT_FALSE(three.empty());
  EXPECT_NE(three.front().find("do not split into 3 equal parts"), std::string::npos) << three.front();
}

}  // namespace
}  // namespace moat
