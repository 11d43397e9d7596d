// Safetensors, checkpoint and typed tensor access (weight_map) on small files written to a temp
// directory, with the writer for good files and by hand for corrupted bytes. Which tensors a
// model needs is the weight spec's business: tests/models/weight_spec_test.cpp.
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
#include "test_files.h"

namespace moat {
namespace {

using namespace testing_files;

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

TEST(WeightMap, Bf16WeightIsNotCopied) {
  TempDir dir;
  ModelConfig c = tiny_config();
  const std::string name = "w.weight";
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors", {bf16_tensor("a", {3}), bf16_tensor(name, {16, 8}, 5)}).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
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

// check_tensor decides the dtypes by storage: fp8 only for a quantizable matrix of an fp8 config.
TEST(WeightMap, CheckTensorByStorage) {
  TempDir dir;
  ASSERT_TRUE(write_safetensors(dir / "model.safetensors",
                                {bf16_tensor("v", {4}), bf16_tensor("m", {4, 2}),
                                 {"q", DType::F8_E4M3, {4, 2}, std::vector<uint8_t>(8, 0x38)},
                                 {"q_scale_inv", DType::F32, {1, 1}, f32_bytes({1.0f})}})
                  .ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  const ModelConfig fp8 = tiny_config(/*fp8=*/true);
  const std::vector<int64_t> v4 = {4}, m42 = {4, 2};
  EXPECT_TRUE(check_tensor(*ckpt, "v", v4, TensorStorage::vector, fp8).ok());
  EXPECT_TRUE(check_tensor(*ckpt, "m", m42, TensorStorage::matrix_no_quant, fp8).ok());
  EXPECT_TRUE(check_tensor(*ckpt, "q", m42, TensorStorage::matrix, fp8).ok());
  auto no_quant = check_tensor(*ckpt, "q", m42, TensorStorage::matrix_no_quant, fp8);
  ASSERT_FALSE(no_quant.ok());
  EXPECT_HAS(no_quant.error().message, "q: expected dtype BF16, F16 or F32, got F8_E4M3");
  auto shape = check_tensor(*ckpt, "v", std::vector<int64_t>{5}, TensorStorage::vector, fp8);
  ASSERT_FALSE(shape.ok());
  EXPECT_HAS(shape.error().message, "v: expected shape [5], got [4] (in model.safetensors)");
  auto missing = check_tensor(*ckpt, "x", m42, TensorStorage::matrix, fp8);
  ASSERT_FALSE(missing.ok());
  EXPECT_HAS(missing.error().message, "x: missing from the checkpoint (expected shape [4, 2])");
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

}  // namespace
}  // namespace moat
