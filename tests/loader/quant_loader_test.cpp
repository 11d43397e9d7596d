// 4-bit weights through the loader: compressed-tensors MXFP4 ("X.weight_packed" U8 + e8m0
// "X.weight_scale") and INT4 ("X.weight_packed" I32 + BF16 "X.weight_scale" + "X.weight_shape")
// come back from get_matrix as zero-copy MXFP4 / INT4_G32 views that decode like the numpy decode of
// tests/golden/quant (tools/make_quant_fixture.py), and gpt-oss "_blocks" / "_scales" as one view per
// expert. Hostile checkpoints (a wrong scale shape, in_features odd or not a multiple of 32, a
// packed shape or weight_shape disagreeing with the model, an e8m0 scale of 255, a NaN bf16 scale,
// wrong dtypes, missing siblings, packed tensors where the model needs bf16) are refused with the
// tensor, what was expected, what was found and the shard.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "config/model_config.h"
#include "config/quantization_config.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "loader/weight_map.h"
#include "test_files.h"

namespace moat {
namespace {

using namespace testing_files;

const fs::path kFixture = fs::path(MOAT_SOURCE_DIR) / "tests/golden/quant/quant_fixture.safetensors";

// tiny_config() with a compressed-tensors quantization_config of the given weight type ("float":
// MXFP4, "int": INT4), through the real parser.
ModelConfig ct_config(const std::string& type) {
  ModelConfig c = tiny_config();
  const json q = {{"quant_method", "compressed-tensors"},
                  {"format", type == "float" ? "mxfp4-pack-quantized" : "pack-quantized"},
                  {"config_groups",
                   {{"group_0",
                     {{"targets", {"Linear"}},
                      {"weights",
                       {{"num_bits", 4}, {"type", type}, {"strategy", "group"}, {"group_size", 32}, {"symmetric", true}}}}}}},
                  {"ignore", {"lm_head"}}};
  auto parsed = parse_compressed_tensors_quantization(q);
  EXPECT_TRUE(parsed.ok()) << parsed.error().message;
  c.quantization = parsed.value();
  return c;
}

std::vector<float> f32_of(const TensorInfo& t) {
  std::vector<float> v(t.nbytes / 4);
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

TEST(QuantLoader, FixtureMatricesDecodeLikeNumpyWithoutCopies) {
  auto ckpt = Checkpoint::open(kFixture);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  const int64_t N = 12, K = 160;
  for (const auto& [prefix, type, dtype] : {std::tuple{"mx", "float", DType::MXFP4}, {"int4", "int", DType::INT4_G32}}) {
    const std::string name = std::string(prefix) + ".weight";
    const ModelConfig c = ct_config(type);
    ASSERT_EQ(c.quantization->weight_dtype, dtype);
    EXPECT_TRUE(check_tensor(*ckpt, name, std::vector<int64_t>{N, K}, TensorStorage::matrix, c).ok());
    auto w = get_matrix(*ckpt, name, N, K, c);
    ASSERT_TRUE(w.ok()) << w.error().message;
    EXPECT_EQ(w->dtype, dtype);
    EXPECT_EQ(w->data, ckpt->find(name + "_packed")->data);  // zero-copy
    EXPECT_EQ(w->group_scales, ckpt->find(name + "_scale")->data);
    EXPECT_EQ(w->bytes(), static_cast<int64_t>(ckpt->find(name + "_packed")->nbytes + ckpt->find(name + "_scale")->nbytes));
    const auto want = f32_of(*ckpt->find(std::string(prefix) + ".expected"));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(w->at(r, k), want[r * K + k]) << name << " [" << r << ", " << k << "]";
  }
  auto experts = get_gpt_oss_mxfp4_experts(*ckpt, "gptoss.w", 2, N, K);
  ASSERT_TRUE(experts.ok()) << experts.error().message;
  ASSERT_EQ(experts->size(), 2u);
  const auto want = f32_of(*ckpt->find("gptoss.expected"));
  for (int64_t e = 0; e < 2; ++e) {
    const WeightMatrix& w = (*experts)[e];
    EXPECT_EQ(w.dtype, DType::MXFP4);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(w.at(r, k), want[(e * N + r) * K + k]) << e << " " << r << " " << k;
  }
}

// ---- hostile checkpoints -----------------------------------------------------------------------

constexpr int64_t kN = 8, kK = 64;  // [8, 64]: two groups per row

std::vector<uint8_t> codes(int64_t bytes) {
  std::vector<uint8_t> v(static_cast<size_t>(bytes));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 37 + 11);
  return v;
}
std::vector<uint8_t> i64_bytes(std::vector<int64_t> v) {
  std::vector<uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
TensorToWrite mx_scale(const std::string& name, std::vector<int64_t> shape, uint8_t fill = 127) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {name, DType::U8, std::move(shape), std::vector<uint8_t>(static_cast<size_t>(n), fill)};
}

// A checkpoint of the given tensors, opened; the error of get_matrix(name, out, in) under `c`.
class QuantCheckpoint {
 public:
  explicit QuantCheckpoint(const std::vector<TensorToWrite>& tensors) {
    EXPECT_TRUE(write_safetensors(dir_ / "model.safetensors", tensors).ok());
    auto c = Checkpoint::open(dir_.path());
    EXPECT_TRUE(c.ok()) << c.error().message;
    ckpt_.emplace(std::move(c).value());
  }
  const Checkpoint& ckpt() const { return *ckpt_; }
  std::string error(const std::string& name, int64_t out, int64_t in, const ModelConfig& c,
                    TensorStorage storage = TensorStorage::matrix) const {
    const auto via_get = get_matrix(*ckpt_, name, out, in, c, storage == TensorStorage::matrix);
    const auto via_check = check_tensor(*ckpt_, name, std::vector<int64_t>{out, in}, storage, c);
    EXPECT_EQ(via_get.ok(), via_check.ok()) << name;
    if (via_get.ok()) return "(loaded)";
    EXPECT_EQ(via_get.error().message, via_check.error().message);
    return via_get.error().message;
  }

 private:
  TempDir dir_;
  std::optional<Checkpoint> ckpt_;
};

TEST(QuantLoaderHostile, WrongScaleShape) {
  QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}, mx_scale("w.weight_scale", {kN, 1})});
  const std::string e = q.error("w.weight", kN, kK, ct_config("float"));
  EXPECT_HAS(e, "w.weight_scale: expected shape [8, 2] (e8m0 scales [out, in/32] of w.weight [8, 64]), got [8, 1] "
                "(in model.safetensors)");
}

TEST(QuantLoaderHostile, OddOrUngroupedInFeatures) {
  QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, 16}, codes(kN * 16)}, mx_scale("w.weight_scale", {kN, 1})});
  EXPECT_HAS(q.error("w.weight", kN, 33, ct_config("float")),
             "w.weight: in_features 33 is not a multiple of 32, the MXFP4 group size");
  EXPECT_HAS(q.error("w.weight", kN, 48, ct_config("float")),
             "w.weight: in_features 48 is not a multiple of 32, the MXFP4 group size");
}

TEST(QuantLoaderHostile, PackedShapeDisagreesWithTheModel) {
  QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2 + 1}, codes(kN * (kK / 2 + 1))},
                     mx_scale("w.weight_scale", {kN, 2})});
  EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")),
             "w.weight_packed: expected shape [8, 32] (MXFP4 codes [out, in/2] of w.weight [8, 64]), got [8, 33] (in "
             "model.safetensors)");
}

TEST(QuantLoaderHostile, Int4PackedShapeOrWeightShapeDisagree) {
  auto scales = bf16_tensor("w.weight_scale", {kN, 2});
  {
    QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 8}, codes(kN * kK / 8 * 4)}, scales,
                       {"w.weight_shape", DType::I64, {2}, i64_bytes({kN, 2 * kK})}});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("int")),
               "w.weight_shape: says the unpacked weight is [8, 128], the model expects [8, 64] for w.weight (in "
               "model.safetensors)");
  }
  {
    QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 4}, codes(kN * kK / 4 * 4)}, scales,
                       {"w.weight_shape", DType::I64, {2}, i64_bytes({kN, kK})}});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("int")),
               "w.weight_packed: expected shape [8, 8] (INT4 codes [out, in/8] of w.weight [8, 64]), got [8, 16]");
  }
  {
    QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 8}, codes(kN * kK / 8 * 4)}, scales});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("int")), "w.weight_shape: missing from the checkpoint");
  }
  {
    QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 8}, codes(kN * kK / 8 * 4)}, scales,
                       {"w.weight_shape", DType::F32, {2}, f32_bytes({8, 64})}});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("int")),
               "w.weight_shape: expected an I32 or I64 tensor of shape [2], got F32 [2]");
  }
  {  // I32 weight_shape is accepted, and the view loads
    std::vector<uint8_t> shape(8);
    const int32_t v[2] = {kN, kK};
    std::memcpy(shape.data(), v, 8);
    QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 8}, codes(kN * kK / 8 * 4)}, scales,
                       {"w.weight_shape", DType::I32, {2}, shape}});
    EXPECT_EQ(q.error("w.weight", kN, kK, ct_config("int")), "(loaded)");
  }
}

TEST(QuantLoaderHostile, E8m0ScaleOf255IsRefusedNamingRowAndGroup) {
  auto s = mx_scale("w.weight_scale", {kN, 2});
  s.bytes[5 * 2 + 1] = 0xff;
  QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}, s});
  EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")),
             "w.weight_scale: the e8m0 scale of row 5, group 1 is 255 (NaN); every scale must be finite (in "
             "model.safetensors)");
}

TEST(QuantLoaderHostile, NonFiniteBf16ScaleIsRefused) {
  std::vector<float> v(kN * 2, 0.01f);
  v[3 * 2 + 0] = std::numeric_limits<float>::infinity();
  QuantCheckpoint q({{"w.weight_packed", DType::I32, {kN, kK / 8}, codes(kN * kK / 8 * 4)},
                     {"w.weight_scale", DType::BF16, {kN, 2}, bf16_bytes(v)},
                     {"w.weight_shape", DType::I64, {2}, i64_bytes({kN, kK})}});
  EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("int")), "w.weight_scale: the bf16 scale of row 3, group 0 is inf");
}

TEST(QuantLoaderHostile, WrongDtypesAndMissingSiblings) {
  {
    QuantCheckpoint q({{"w.weight_packed", DType::I8, {kN, kK / 2}, codes(kN * kK / 2)}, mx_scale("w.weight_scale", {kN, 2})});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")), "w.weight_packed: expected dtype U8 (MXFP4 codes");
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")), "got I8 (in model.safetensors)");
  }
  {  // MXFP4 scales must be e8m0 bytes, INT4's bf16
    QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}, bf16_tensor("w.weight_scale", {kN, 2})});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")), "w.weight_scale: expected dtype U8 (e8m0 scales");
  }
  {
    QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}});
    EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float")),
               "w.weight_scale: missing from the checkpoint (e8m0 scales [out, in/32] of w.weight [8, 64]: U8 [8, 2])");
  }
}

TEST(QuantLoaderHostile, PackedWhereTheModelNeedsBf16OrTwice) {
  QuantCheckpoint q({{"w.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}, mx_scale("w.weight_scale", {kN, 2}),
                     {"d.weight_packed", DType::U8, {kN, kK / 2}, codes(kN * kK / 2)}, mx_scale("d.weight_scale", {kN, 2}),
                     bf16_tensor("d.weight", {kN, kK})});
  EXPECT_HAS(q.error("w.weight", kN, kK, ct_config("float"), TensorStorage::matrix_no_quant),
             "w.weight_packed: w.weight must stay BF16, F16 or F32 (embeddings, lm_head, router), but the checkpoint "
             "holds it packed (in model.safetensors)");
  EXPECT_HAS(q.error("d.weight", kN, kK, ct_config("float")),
             "d.weight: present both unpacked and as d.weight_packed");
  // a packed tensor in a checkpoint whose config does not say how it is packed
  EXPECT_HAS(q.error("w.weight", kN, kK, tiny_config()),
             "w.weight: missing from the checkpoint; w.weight_packed is there (in model.safetensors), but config.json "
             "has no compressed-tensors quantization_config");
  // per tensor: bf16 tensors of a compressed-tensors checkpoint load as bf16
  auto plain = get_matrix(q.ckpt(), "d.weight", kN, kK, tiny_config());
  ASSERT_TRUE(plain.ok()) << plain.error().message;
  EXPECT_EQ(plain->dtype, DType::BF16);
}

TEST(QuantLoaderHostile, GptOssShapesAndScales) {
  auto blocks = [](int64_t e, int64_t n, int64_t g) {
    return TensorToWrite{"x_blocks", DType::U8, {e, n, g, 16}, codes(e * n * g * 16)};
  };
  {
    QuantCheckpoint q({blocks(2, kN, 2), mx_scale("x_scales", {2, kN, 3})});
    auto r = get_gpt_oss_mxfp4_experts(q.ckpt(), "x", 2, kN, kK);
    ASSERT_FALSE(r.ok());
    EXPECT_HAS(r.error().message, "x_scales: expected shape [2, 8, 2]");
    EXPECT_HAS(r.error().message, "got [2, 8, 3] (in model.safetensors)");
  }
  {
    QuantCheckpoint q({blocks(2, kN, 2), mx_scale("x_scales", {2, kN, 2})});
    auto r = get_gpt_oss_mxfp4_experts(q.ckpt(), "x", 3, kN, kK);
    ASSERT_FALSE(r.ok());
    EXPECT_HAS(r.error().message, "x_blocks: expected shape [3, 8, 2, 16]");
  }
  {
    auto s = mx_scale("x_scales", {2, kN, 2});
    s.bytes[(1 * kN + 6) * 2 + 1] = 0xff;
    QuantCheckpoint q({blocks(2, kN, 2), s});
    auto r = get_gpt_oss_mxfp4_experts(q.ckpt(), "x", 2, kN, kK);
    ASSERT_FALSE(r.ok());
    EXPECT_HAS(r.error().message, "x_scales: the e8m0 scale of expert 1, row 6, group 1 is 255 (NaN)");
  }
}

}  // namespace
}  // namespace moat
