// Safetensors, checkpoint and weight-map tests on small files written to a temp directory,
// with the writer for good files and by hand for corrupted bytes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "config/model_config.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "loader/weight_map.h"

namespace moat {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("moat_loader_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

// A deterministic pattern of small, bf16-exact values.
std::vector<float> pattern(int64_t n, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + seed * 13) % 17 - 8) / 8.0f;
  return v;
}

TensorToWrite bf16_tensor(const std::string& name, std::vector<int64_t> shape, int seed = 0) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return {name, DType::BF16, std::move(shape), bf16_bytes(pattern(n, seed))};
}

// Raw file: 8-byte length + header text + data bytes.
void write_raw(const fs::path& path, const std::string& header, size_t data_bytes,
               std::optional<uint64_t> declared_len = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  uint64_t len = declared_len.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  out << header;
  for (size_t i = 0; i < data_bytes; ++i) out.put(0);
}

std::string open_error(const fs::path& path) {
  auto f = SafetensorsFile::open(path);
  return f.ok() ? std::string("(opened)") : f.error().message;
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

// ---------------------------------------------------------------- safetensors

TEST(Safetensors, RoundTripsEveryDtypeInFileOrder) {
  TempDir dir;
  std::vector<TensorToWrite> tensors = {
      bf16_tensor("b", {2, 3}),
      {"a", DType::F32, {4}, f32_bytes({1.0f, -2.0f, 3.5f, 0.25f})},
      {"fp8", DType::F8_E4M3, {2, 2}, {0x38, 0xb8, 0x00, 0x7e}},
      {"ids", DType::I64, {1}, {5, 0, 0, 0, 0, 0, 0, 0}},
      {"mask", DType::BOOL, {3}, {1, 0, 1}},
      {"empty", DType::F16, {0, 4}, {}},
  };
  ASSERT_TRUE(write_safetensors(dir / "x.safetensors", tensors).ok());
  auto f = SafetensorsFile::open(dir / "x.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().message;
  const auto& file = *f.value();
  ASSERT_EQ(file.tensors().size(), 6u);
  EXPECT_EQ(file.tensors()[0].name, "b");  // data-offset order, not name order
  EXPECT_EQ(file.tensors()[1].name, "a");

  const TensorInfo* a = file.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::F32);
  EXPECT_EQ(a->shape, std::vector<int64_t>({4}));
  EXPECT_EQ(a->numel(), 4);
  EXPECT_EQ(a->nbytes, 16u);
  float got[4];
  std::memcpy(got, a->data, 16);
  EXPECT_EQ(got[2], 3.5f);
  // The data buffer starts 8-byte aligned (header padded), and the first tensor sits at it.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(file.find("b")->data) % 8, 0u);
  EXPECT_EQ(file.find("fp8")->dtype, DType::F8_E4M3);
  EXPECT_EQ(static_cast<uint8_t>(file.find("fp8")->data[3]), 0x7e);
  EXPECT_EQ(file.find("ids")->dtype, DType::I64);
  EXPECT_EQ(file.find("mask")->dtype, DType::BOOL);
  EXPECT_EQ(file.find("empty")->nbytes, 0u);
  EXPECT_EQ(file.find("nope"), nullptr);
  EXPECT_EQ(file.file_size(), fs::file_size(dir / "x.safetensors"));
  EXPECT_EQ(a->file, (dir / "x.safetensors").string());
}

TEST(Safetensors, WriterRejectsWrongByteCount) {
  TempDir dir;
  auto s = write_safetensors(dir / "x.safetensors", {{"w", DType::BF16, {2, 2}, {1, 2, 3}}});
  ASSERT_FALSE(s.ok());
  EXPECT_HAS(s.error().message, "'w'");
  EXPECT_HAS(s.error().message, "needs 8 bytes, got 3");
}

TEST(SafetensorsErrors, TruncatedBelowEightBytes) {
  TempDir dir;
  {
    std::ofstream(dir / "t.safetensors", std::ios::binary) << "abcd";
  }
  std::string e = open_error(dir / "t.safetensors");
  EXPECT_HAS(e, "t.safetensors");
  EXPECT_HAS(e, "truncated: 4 bytes");
}

TEST(SafetensorsErrors, MissingFile) {
  TempDir dir;
  std::string e = open_error(dir / "absent.safetensors");
  EXPECT_HAS(e, "absent.safetensors: cannot open");
}

TEST(SafetensorsErrors, HeaderLengthPastEndOfFile) {
  TempDir dir;
  write_raw(dir / "h.safetensors", "{}", 0, /*declared_len=*/1000);
  std::string e = open_error(dir / "h.safetensors");
  EXPECT_HAS(e, "h.safetensors");
  EXPECT_HAS(e, "header length 1000 runs past the end of the file (10 bytes)");
}

TEST(SafetensorsErrors, InvalidHeaderJson) {
  TempDir dir;
  write_raw(dir / "j.safetensors", "{\"w\": {\"dtype\": ", 0);
  std::string e = open_error(dir / "j.safetensors");
  EXPECT_HAS(e, "j.safetensors: invalid header JSON");
  write_raw(dir / "k.safetensors", "[1, 2]", 0);
  EXPECT_HAS(open_error(dir / "k.safetensors"), "expected an object");
}

TEST(SafetensorsErrors, UnknownDtype) {
  TempDir dir;
  write_raw(dir / "d.safetensors",
            R"({"w": {"dtype": "F8_E5M3", "shape": [2], "data_offsets": [0, 2]}})", 2);
  std::string e = open_error(dir / "d.safetensors");
  EXPECT_HAS(e, "d.safetensors: tensor 'w': unknown dtype \"F8_E5M3\"");
}

TEST(SafetensorsErrors, ShapeDisagreesWithOffsets) {
  TempDir dir;
  write_raw(dir / "s.safetensors",
            R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", 10);
  std::string e = open_error(dir / "s.safetensors");
  EXPECT_HAS(e, "s.safetensors: tensor 'w': shape [2, 3] of BF16 needs 12 bytes");
  EXPECT_HAS(e, "hold 10");
}

TEST(SafetensorsErrors, OffsetsPastEndOfFile) {
  TempDir dir;
  // A good file cut short: the last tensor's bytes are no longer there.
  ASSERT_TRUE(write_safetensors(dir / "o.safetensors",
                                {bf16_tensor("first", {4}), bf16_tensor("last", {8})})
                  .ok());
  fs::resize_file(dir / "o.safetensors", fs::file_size(dir / "o.safetensors") - 6);
  std::string e = open_error(dir / "o.safetensors");
  EXPECT_HAS(e, "o.safetensors: tensor 'last': data_offsets [8, 24] run past the end");
}

TEST(SafetensorsErrors, OverlappingTensors) {
  TempDir dir;
  write_raw(dir / "v.safetensors",
            R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
            R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            12);
  std::string e = open_error(dir / "v.safetensors");
  EXPECT_HAS(e, "v.safetensors: tensors 'a' [0, 8) and 'b' [4, 12) overlap");
}

TEST(SafetensorsErrors, MetadataIsSkippedButMalformedEntriesAreNot) {
  TempDir dir;
  write_raw(dir / "m.safetensors",
            R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})",
            2);
  auto f = SafetensorsFile::open(dir / "m.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().message;
  EXPECT_EQ(f.value()->tensors().size(), 1u);
  write_raw(dir / "n.safetensors", R"({"w": {"dtype": "U8", "shape": [2]}})", 2);
  EXPECT_HAS(open_error(dir / "n.safetensors"), "tensor 'w': 'data_offsets' must be");
}

// ---------------------------------------------------------------- checkpoint

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  ASSERT_TRUE(
      write_safetensors(dir / "model.safetensors", {bf16_tensor("x", {3}), bf16_tensor("y", {5})})
          .ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  EXPECT_EQ(ckpt->names(), std::vector<std::string>({"x", "y"}));
  EXPECT_EQ(ckpt->total_bytes(), 16u);
  ASSERT_NE(ckpt->find("y"), nullptr);
  EXPECT_EQ(ckpt->find("y")->shape, std::vector<int64_t>({5}));
  // A .safetensors path works as well.
  auto direct = Checkpoint::open(dir / "model.safetensors");
  ASSERT_TRUE(direct.ok()) << direct.error().message;
  EXPECT_NE(direct->find("x"), nullptr);
}

void write_index(const fs::path& dir, const json& weight_map) {
  std::ofstream(dir / "model.safetensors.index.json")
      << json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
}

TEST(Checkpoint, ShardedRoundTrip) {
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir / "model-00001-of-00002.safetensors",
                                {bf16_tensor("a", {2, 2}, 1), bf16_tensor("b", {3}, 2)})
                  .ok());
  ASSERT_TRUE(write_safetensors(dir / "model-00002-of-00002.safetensors",
                                {{"c", DType::F32, {2}, f32_bytes({7.0f, 8.0f})}})
                  .ok());
  write_index(dir.path(), {{"a", "model-00001-of-00002.safetensors"},
                           {"b", "model-00001-of-00002.safetensors"},
                           {"c", "model-00002-of-00002.safetensors"}});
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  EXPECT_EQ(ckpt->files().size(), 2u);
  EXPECT_EQ(ckpt->names(), std::vector<std::string>({"a", "b", "c"}));
  EXPECT_EQ(ckpt->total_bytes(), 8u + 6u + 8u);
  const TensorInfo* c = ckpt->find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(fs::path(c->file).filename(), "model-00002-of-00002.safetensors");
  auto v = get_vector_f32(*ckpt, "c", 2);
  ASSERT_TRUE(v.ok()) << v.error().message;
  EXPECT_EQ(v.value(), std::vector<float>({7.0f, 8.0f}));
  auto b = get_vector_f32(*ckpt, "b", 3);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b.value(), std::vector<float>(pattern(3, 2)));
  // The checkpoint outlives a move (tensor pointers stay valid).
  Checkpoint moved = std::move(ckpt.value());
  EXPECT_EQ(moved.find("a")->shape, std::vector<int64_t>({2, 2}));
}

TEST(CheckpointErrors, ShardNamedInIndexIsMissing) {
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir / "model-00001-of-00002.safetensors", {bf16_tensor("a", {2})})
                  .ok());
  write_index(dir.path(), {{"a", "model-00001-of-00002.safetensors"},
                           {"b", "model-00002-of-00002.safetensors"}});
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_HAS(ckpt.error().message, "shard 'model-00002-of-00002.safetensors' (holding 'b') is "
                                   "missing");
  EXPECT_HAS(ckpt.error().message, "model.safetensors.index.json");
}

TEST(CheckpointErrors, TensorNamedInIndexAbsentFromShard) {
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir / "s1.safetensors", {bf16_tensor("a", {2})}).ok());
  write_index(dir.path(), {{"a", "s1.safetensors"}, {"ghost", "s1.safetensors"}});
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_HAS(ckpt.error().message,
             "tensor 'ghost' is mapped to shard 's1.safetensors', which does not contain it");
}

TEST(CheckpointErrors, NoCheckpointFiles) {
  TempDir dir;
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_HAS(ckpt.error().message, dir.path().string());
  EXPECT_HAS(ckpt.error().message, "model.safetensors or model.safetensors.index.json");
}

TEST(CheckpointErrors, CorruptShardIsNamed) {
  TempDir dir;
  {
    std::ofstream(dir / "s1.safetensors", std::ios::binary) << "xy";
  }
  write_index(dir.path(), {{"a", "s1.safetensors"}});
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_FALSE(ckpt.ok());
  EXPECT_HAS(ckpt.error().message, "s1.safetensors: truncated");
}

// ---------------------------------------------------------------- weight map

// A tiny V3-shaped model: layer 0 dense, layer 1 MoE (4 experts in 2 groups, noaux_tc).
ModelConfig tiny_config(bool fp8 = false, bool q_lora = true) {
  json j = {{"architectures", {"DeepseekV3ForCausalLM"}},
            {"model_type", "deepseek_v3"},
            {"vocab_size", 32},
            {"hidden_size", 16},
            {"intermediate_size", 24},
            {"moe_intermediate_size", 8},
            {"num_hidden_layers", 2},
            {"num_nextn_predict_layers", 1},
            {"num_attention_heads", 2},
            {"num_key_value_heads", 2},
            {"q_lora_rank", q_lora ? json(12) : json(nullptr)},
            {"kv_lora_rank", 8},
            {"qk_nope_head_dim", 4},
            {"qk_rope_head_dim", 2},
            {"v_head_dim", 4},
            {"n_routed_experts", 4},
            {"n_shared_experts", 1},
            {"num_experts_per_tok", 2},
            {"n_group", 2},
            {"topk_group", 1},
            {"first_k_dense_replace", 1}};
  if (fp8)
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {128, 128}}};
  auto c = parse_model_config(j);
  EXPECT_TRUE(c.ok()) << c.error().message;
  return c.value();
}

// Every expected tensor (bf16, or fp8 + scales for quantizable matrices) plus one MTP layer.
std::vector<TensorToWrite> model_tensors(const ModelConfig& c, bool fp8) {
  std::vector<TensorToWrite> out;
  int seed = 0;
  for (const ExpectedTensor& e : expected_tensors(c)) {
    if (fp8 && e.kind == ExpectedTensor::Kind::kMatrix) {
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

TEST(WeightMap, ExpectedTensorNamesAndShapes) {
  ModelConfig c = tiny_config();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : expected_tensors(c)) shapes[e.name] = e.shape;
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
  for (const auto& e : expected_tensors(no_q_lora)) s2[e.name] = e.shape;
  EXPECT_EQ(s2.at("model.layers.0.self_attn.q_proj.weight"), S({12, 16}));
  EXPECT_EQ(s2.count("model.layers.0.self_attn.q_a_proj.weight"), 0u);
  EXPECT_EQ(s2.count("lm_head.weight"), 0u);
  EXPECT_EQ(s2.count("model.layers.1.mlp.gate.e_score_correction_bias"), 0u);
}

TEST(WeightMap, ShardedBf16CheckpointValidates) {
  TempDir dir;
  ModelConfig c = tiny_config();
  write_sharded(dir.path(), model_tensors(c, false));
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto s = validate_checkpoint(*ckpt, c);
  EXPECT_TRUE(s.ok()) << s.error().message;
}

TEST(WeightMap, Bf16WeightIsNotCopied) {
  TempDir dir;
  ModelConfig c = tiny_config();
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", model_tensors(c, false)).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  const std::string name = "model.layers.0.self_attn.kv_b_proj.weight";
  auto w = get_matrix(*ckpt, name, 16, 8, c);
  ASSERT_TRUE(w.ok()) << w.error().message;
  EXPECT_EQ(w->dtype, DType::BF16);
  EXPECT_EQ(w->scale_inv, nullptr);
  EXPECT_EQ(w->data, ckpt->find(name)->data);
  const auto& file = *ckpt->files().at(0);
  const auto* p = static_cast<const std::byte*>(w->data);
  EXPECT_GE(p, file.mapping());
  EXPECT_LE(p + w->bytes(), file.mapping() + file.file_size());
  // Values read through the view are the stored ones.
  const TensorInfo* t = ckpt->find(name);
  uint16_t bits;
  std::memcpy(&bits, t->data + 2 * (3 * 8 + 5), 2);
  EXPECT_EQ(w->at(3, 5), bf16_to_f32(bits));
}

TEST(WeightMap, Fp8WeightWithNonAlignedEdgeScales) {
  TempDir dir;
  ModelConfig c = tiny_config(/*fp8=*/true);
  // [200, 300] fp8 -> scale_inv [ceil(200/128), ceil(300/128)] = [2, 3].
  std::vector<uint8_t> q(200 * 300);
  for (int64_t i = 0; i < 200; ++i)
    for (int64_t j = 0; j < 300; ++j)
      q[i * 300 + j] = f32_to_fp8_e4m3(static_cast<float>((i + j) % 5) - 2.0f);
  const std::vector<float> scales = {1.0f, 2.0f, 4.0f, 8.0f, 16.0f, 32.0f};
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors",
                                {{"w.weight", DType::F8_E4M3, {200, 300}, q},
                                 {"w.weight_scale_inv", DType::F32, {2, 3}, f32_bytes(scales)},
                                 {"bad.weight", DType::F8_E4M3, {200, 300}, q},
                                 {"bad.weight_scale_inv", DType::F32, {1, 3},
                                  f32_bytes({1, 2, 3})},
                                 {"noscale.weight", DType::F8_E4M3, {200, 300}, q}})
                  .ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto w = get_matrix(*ckpt, "w.weight", 200, 300, c);
  ASSERT_TRUE(w.ok()) << w.error().message;
  EXPECT_EQ(w->dtype, DType::F8_E4M3);
  ASSERT_NE(w->scale_inv, nullptr);
  EXPECT_EQ(w->scale_cols(), 3);
  EXPECT_EQ(w->data, ckpt->find("w.weight")->data);
  auto expect_at = [&](int64_t i, int64_t j) {
    const float v = static_cast<float>((i + j) % 5) - 2.0f;
    EXPECT_EQ(w->at(i, j), v * scales[(i / 128) * 3 + j / 128]) << i << "," << j;
  };
  expect_at(0, 0);
  expect_at(127, 127);
  expect_at(128, 0);     // second block row
  expect_at(0, 256);     // third block column (the ragged 44-wide edge)
  expect_at(199, 299);   // last element: block [1, 2]
  expect_at(150, 200);

  auto bad = get_matrix(*ckpt, "bad.weight", 200, 300, c);
  ASSERT_FALSE(bad.ok());
  EXPECT_HAS(bad.error().message, "bad.weight_scale_inv: expected shape [2, 3]");
  EXPECT_HAS(bad.error().message, "got [1, 3]");
  auto noscale = get_matrix(*ckpt, "noscale.weight", 200, 300, c);
  ASSERT_FALSE(noscale.ok());
  EXPECT_HAS(noscale.error().message, "noscale.weight_scale_inv: missing");

  // fp8 without quantization_config in config.json is refused.
  auto plain = get_matrix(*ckpt, "w.weight", 200, 300, tiny_config(false));
  ASSERT_FALSE(plain.ok());
  EXPECT_HAS(plain.error().message, "no quantization_config");
}

TEST(WeightMap, Fp8CheckpointValidates) {
  TempDir dir;
  ModelConfig c = tiny_config(/*fp8=*/true);
  write_sharded(dir.path(), model_tensors(c, true));
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  auto s = validate_checkpoint(*ckpt, c);
  EXPECT_TRUE(s.ok()) << s.error().message;
  auto w = get_matrix(*ckpt, "model.layers.1.mlp.experts.2.down_proj.weight", 16, 8, c);
  ASSERT_TRUE(w.ok()) << w.error().message;
  EXPECT_EQ(w->at(15, 7), 1.0f * 0.5f);  // code 0x38 is 1.0, scale 0.5
}

TEST(WeightMap, GetVectorConvertsBf16F16F32) {
  TempDir dir;
  std::vector<uint8_t> f16(4);
  uint16_t h0 = f32_to_f16(1.5f), h1 = f32_to_f16(-0.25f);
  std::memcpy(&f16[0], &h0, 2);
  std::memcpy(&f16[2], &h1, 2);
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors",
                                {{"h", DType::F16, {2}, f16},
                                 {"b", DType::BF16, {2}, bf16_bytes({3.0f, -1.0f})},
                                 {"i", DType::I32, {2}, std::vector<uint8_t>(8, 0)}})
                  .ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(get_vector_f32(*ckpt, "h", 2).value(), std::vector<float>({1.5f, -0.25f}));
  EXPECT_EQ(get_vector_f32(*ckpt, "b", 2).value(), std::vector<float>({3.0f, -1.0f}));
  auto wrong_n = get_vector_f32(*ckpt, "b", 3);
  ASSERT_FALSE(wrong_n.ok());
  EXPECT_HAS(wrong_n.error().message, "b: expected shape [3], got [2]");
  auto wrong_dtype = get_vector_f32(*ckpt, "i", 2);
  ASSERT_FALSE(wrong_dtype.ok());
  EXPECT_HAS(wrong_dtype.error().message, "i: expected dtype BF16, F16 or F32, got I32");
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
  auto s = validate_checkpoint(*ckpt, c);
  return s.ok() ? std::string("(valid)") : s.error().message;
}

TEST(WeightMapErrors, MissingTensor) {
  std::string e = validate_with("model.layers.1.mlp.experts.2.up_proj.weight", std::nullopt);
  EXPECT_HAS(e, "model.layers.1.mlp.experts.2.up_proj.weight: missing from the checkpoint "
                "(expected shape [8, 16])");
  e = validate_with("model.layers.1.mlp.gate.e_score_correction_bias", std::nullopt);
  EXPECT_HAS(e, "model.layers.1.mlp.gate.e_score_correction_bias: missing");
}

TEST(WeightMapErrors, WrongShapeNamesTheShard) {
  const std::string name = "model.layers.1.self_attn.kv_b_proj.weight";
  std::string e = validate_with(name, bf16_tensor(name, {16, 4}));
  EXPECT_HAS(e, name + ": expected shape [16, 8], got [16, 4] (in model-0000");
  EXPECT_HAS(e, "-of-00002.safetensors)");
}

TEST(WeightMapErrors, WrongDtype) {
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

TEST(WeightMapErrors, Fp8ScaleMissingOrWrongDtype) {
  const std::string w = "model.layers.0.mlp.up_proj.weight";
  std::string e = validate_with(w + "_scale_inv", std::nullopt, /*fp8=*/true);
  EXPECT_HAS(e, w + "_scale_inv: missing");
  e = validate_with(w + "_scale_inv", bf16_tensor(w + "_scale_inv", {1, 1}), /*fp8=*/true);
  EXPECT_HAS(e, w + "_scale_inv: expected dtype F32, got BF16");
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

// The checkpoints tools/make_checkpoint.py writes (tests/golden/*): config.json parses and every
// expected tensor is present with the right shape and dtype, MTP layers included in the files.
TEST(GoldenCheckpoints, ConfigAndCheckpointValidate) {
  for (const char* name : {"tiny_qlora", "tiny_v2lite", "tiny_fp8"}) {
    const fs::path dir = fs::path(MOAT_SOURCE_DIR) / "tests/golden" / name;
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << dir << " not present";
    auto config = load_model_config(dir);
    ASSERT_TRUE(config.ok()) << config.error().message;
    auto ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
    auto s = validate_checkpoint(*ckpt, *config);
    EXPECT_TRUE(s.ok()) << name << ": " << s.error().message;
  }
}

}  // namespace
}  // namespace moat
