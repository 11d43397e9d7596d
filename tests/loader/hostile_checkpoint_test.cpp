// Hostile checkpoints: each test copies a small valid checkpoint (tests/golden/tiny_qlora, or the
// sharded fp8 tests/golden/tiny_fp8), corrupts one thing, and checks that opening it is refused
// with a message naming the file, the tensor and the problem: never a crash or a read outside
// the file (the sanitizer build, tools/sanitize.sh, runs these too).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loader/checkpoint.h"
#include "loader/safetensors.h"

namespace moat {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

const fs::path kQlora = fs::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_qlora";
const fs::path kFp8 = fs::path(MOAT_SOURCE_DIR) / "tests/golden/tiny_fp8";
constexpr const char* kFp8Shard = "model-00001-of-00002.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

// A copy of a checkpoint directory (config and weights), removed at the end of the test.
class CheckpointCopy {
 public:
  explicit CheckpointCopy(const fs::path& from) {
    dir_ = fs::temp_directory_path() /
           ("moat_hostile_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const auto& e : fs::directory_iterator(from))
      if (e.path().filename() != "golden.safetensors") fs::copy_file(e.path(), dir_ / e.path().filename());
  }
  ~CheckpointCopy() { fs::remove_all(dir_); }
  const fs::path& dir() const { return dir_; }
  fs::path operator/(const std::string& name) const { return dir_ / name; }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
};

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file taken apart: its header (in file order) and its data buffer.
struct Image {
  ojson header;
  std::string data;

  static Image read(const fs::path& path) {
    const std::string bytes = read_bytes(path);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    return {ojson::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  // Writes `header_text` (default: the header) and the data; `declared` overrides the length field.
  void write(const fs::path& path, std::optional<std::string> header_text = std::nullopt,
             std::optional<uint64_t> declared = std::nullopt) const {
    const std::string text = header_text.value_or(header.dump());
    const uint64_t n = declared.value_or(text.size());
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_bytes(path, bytes + text + data);
  }
  // The name of the tensor at data offset order `rank` (0 = first in the buffer).
  std::string tensor_at(size_t rank) const {
    std::vector<std::pair<uint64_t, std::string>> order;
    for (const auto& [name, v] : header.items())
      if (name != "__metadata__") order.emplace_back(v["data_offsets"][0].get<uint64_t>(), name);
    std::sort(order.begin(), order.end());
    return order.at(rank).second;
  }
};

std::string open_error(const fs::path& dir, WeightPlacement placement = WeightPlacement::mmap) {
  auto c = Checkpoint::open(dir, placement);
  return c.ok() ? std::string("(opened)") : c.error().message;
}

// ---------------------------------------------------------------- the copies are valid

TEST(HostileCheckpoint, UntouchedCopiesOpen) {
  for (const fs::path& src : {kQlora, kFp8}) {
    CheckpointCopy c(src);
    EXPECT_EQ(open_error(c.dir()), "(opened)");
    EXPECT_EQ(open_error(c.dir(), WeightPlacement::memory), "(opened)");
  }
}

// ---------------------------------------------------------------- header

TEST(HostileCheckpoint, HeaderLengthBeyondTheFile) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.write(file, std::nullopt, uint64_t{1} << 40);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": header length 1099511627776 runs past the end of the file");
}

TEST(HostileCheckpoint, HeaderIsNotJson) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.write(file, std::string("{\"model.embed_tokens.weight\": {\"dtype\": BF16"));
  EXPECT_HAS(open_error(c.dir()), file.string() + ": invalid header JSON");
}

TEST(HostileCheckpoint, HeaderIsNotAnObject) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.write(file, std::string("[1, 2, 3]"));
  EXPECT_HAS(open_error(c.dir()), file.string() + ": invalid header JSON: expected an object, got array");
}

// Fuzz finding: nlohmann throws out_of_range (not parse_error) for a number past double, which
// escaped the catch and terminated the process.
TEST(HostileCheckpoint, HeaderNumberPastDoubleIsAnErrorNotACrash) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  std::string text = img.header.dump();
  text.insert(1, "\"__metadata__\": {\"total\": 1e400}, ");
  img.write(file, text);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": invalid header JSON");
  EXPECT_HAS(e, "number overflow");
}

TEST(HostileCheckpoint, HugeHeaderIsRefusedBeforeParsing) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.write(file, std::nullopt, 150'000'000);
  fs::resize_file(file, 150'000'000 + 8);  // sparse: no disk used
  EXPECT_HAS(open_error(c.dir()),
             file.string() + ": header length 150000000 is over the 100000000-byte limit");
}

TEST(HostileCheckpoint, TensorNamedTwiceInTheHeader) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  const std::string name = img.tensor_at(1);
  std::string text = img.header.dump();
  text.insert(1, "\"" + name + "\": " + img.header[name].dump() + ", ");
  img.write(file, text);
  EXPECT_HAS(open_error(c.dir()), file.string() + ": tensor '" + name + "' appears twice in the header");
}

// ---------------------------------------------------------------- data offsets

TEST(HostileCheckpoint, OverlappingOffsets) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  const std::string first = img.tensor_at(0), second = img.tensor_at(1);
  auto& off = img.header[second]["data_offsets"];
  const uint64_t len = off[1].get<uint64_t>() - off[0].get<uint64_t>();
  off = {uint64_t{100}, 100 + len};  // inside the first tensor's bytes
  img.write(file);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": tensors '" + first + "'");
  EXPECT_HAS(e, "'" + second + "' [100, ");
  EXPECT_HAS(e, "overlap in the data buffer");
}

TEST(HostileCheckpoint, OutOfOrderOffsetsLeaveAHole) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  // The first tensor's bytes moved past the second's: [len1, ...) now has a hole at [0, ...).
  const std::string first = img.tensor_at(0), second = img.tensor_at(1);
  const uint64_t end1 = img.header[first]["data_offsets"][1].get<uint64_t>();
  const uint64_t len2 = img.header[second]["data_offsets"][1].get<uint64_t>() - end1;
  img.header[second]["data_offsets"] = {end1 + 64, end1 + 64 + len2};
  img.write(file);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": tensor '" + second + "'");
  EXPECT_HAS(e, "unused after '" + first + "' (safetensors data must be contiguous)");
}

TEST(HostileCheckpoint, BytesAfterTheLastTensor) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  write_bytes(file, read_bytes(file) + std::string(40, 'x'));
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": the tensors cover");
  EXPECT_HAS(e, "40 bytes after '");
  EXPECT_HAS(e, "' belong to no tensor");
}

TEST(HostileCheckpoint, OffsetsPastTheEndOfTheFile) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  const std::string last = img.tensor_at(img.header.size() - 2);  // minus __metadata__
  fs::resize_file(file, fs::file_size(file) - 10);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": tensor '" + last + "': data_offsets [");
  EXPECT_HAS(e, "run past the end of the data buffer");
}

TEST(HostileCheckpoint, OffsetsBeginAfterTheyEnd) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  const std::string name = img.tensor_at(2);
  img.header[name]["data_offsets"] = {uint64_t{500}, uint64_t{400}};
  img.write(file);
  EXPECT_HAS(open_error(c.dir()),
             file.string() + ": tensor '" + name + "': data_offsets [500, 400] end before they begin");
}

TEST(HostileCheckpoint, NegativeOffset) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  const std::string name = img.tensor_at(0);
  img.header[name]["data_offsets"] = {-8, 0};
  img.write(file);
  EXPECT_HAS(open_error(c.dir()), file.string() + ": tensor '" + name +
                                      "': 'data_offsets' must be [begin, end] (non-negative integers), got [-8,0]");
}

// ---------------------------------------------------------------- dtype and shape

TEST(HostileCheckpoint, DtypeDisagreesWithTheByteLength) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.header["model.embed_tokens.weight"]["dtype"] = "F32";  // BF16 [512, 192] on disk
  img.write(file);
  EXPECT_HAS(open_error(c.dir()), file.string() +
                                      ": tensor 'model.embed_tokens.weight': shape [512, 192] of F32 needs "
                                      "393216 bytes, but data_offsets [0, 196608] hold 196608");
}

TEST(HostileCheckpoint, UnknownDtype) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.header["model.embed_tokens.weight"]["dtype"] = "Q4_K";
  img.write(file);
  EXPECT_HAS(open_error(c.dir()),
             file.string() + ": tensor 'model.embed_tokens.weight': unknown dtype \"Q4_K\" (expected one of");
}

TEST(HostileCheckpoint, ShapeWhoseProductOverflowsInt64) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  // 2^31 * 2^31 * 2^31 = 2^93 elements, and a zero dim in front (an "empty" tensor still refused)
  img.header["model.embed_tokens.weight"]["shape"] = {0, int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31};
  img.write(file);
  EXPECT_HAS(open_error(c.dir()), file.string() +
                                      ": tensor 'model.embed_tokens.weight': shape [0, 2147483648, 2147483648, "
                                      "2147483648] has more elements than a 64-bit count holds");
}

TEST(HostileCheckpoint, ShapeWhoseByteCountOverflows) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.header["model.embed_tokens.weight"]["shape"] = {int64_t{1} << 62, 4};  // fits no count of bytes
  img.write(file);
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, file.string() + ": tensor 'model.embed_tokens.weight': shape [4611686018427387904, 4]");
}

TEST(HostileCheckpoint, NegativeDim) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.header["model.embed_tokens.weight"]["shape"] = {-512, -192};
  img.write(file);
  EXPECT_HAS(open_error(c.dir()), file.string() +
                                      ": tensor 'model.embed_tokens.weight': shape [-512,-192] must hold "
                                      "non-negative integers");
}

TEST(HostileCheckpoint, DimPastInt64) {
  CheckpointCopy c(kQlora);
  const fs::path file = c / "model.safetensors";
  Image img = Image::read(file);
  img.header["model.embed_tokens.weight"]["shape"] = {uint64_t{1} << 63, 1};  // reads as negative as int64
  img.write(file);
  EXPECT_HAS(open_error(c.dir()), "must hold non-negative integers");
}

// ---------------------------------------------------------------- shard index

TEST(HostileCheckpoint, IndexNamesAMissingShard) {
  CheckpointCopy c(kFp8);
  fs::remove(c / "model-00002-of-00002.safetensors");
  const std::string e = open_error(c.dir());
  EXPECT_HAS(e, (c / kIndex).string() + ": shard 'model-00002-of-00002.safetensors' (holding '");
  EXPECT_HAS(e, "') is missing from " + c.dir().string());
}

TEST(HostileCheckpoint, IndexNamesATensorTwice) {
  CheckpointCopy c(kFp8);
  std::string text = read_bytes(c / kIndex);
  const size_t at = text.find("\"weight_map\": {");
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 15, "\"model.norm.weight\": \"model-00001-of-00002.safetensors\", ");
  write_bytes(c / kIndex, text);
  EXPECT_HAS(open_error(c.dir()), (c / kIndex).string() + ": weight_map lists tensor 'model.norm.weight' twice");
}

TEST(HostileCheckpoint, IndexMapsATensorToAShardWithoutIt) {
  CheckpointCopy c(kFp8);
  ojson index = ojson::parse(read_bytes(c / kIndex));
  index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors";  // it is in 00001
  write_bytes(c / kIndex, index.dump(2));
  EXPECT_HAS(open_error(c.dir()), (c / kIndex).string() +
                                      ": tensor 'model.embed_tokens.weight' is mapped to shard "
                                      "'model-00002-of-00002.safetensors', which does not contain it");
}

TEST(HostileCheckpoint, IndexNamesAShardOutsideTheDirectory) {
  CheckpointCopy c(kFp8);
  ojson index = ojson::parse(read_bytes(c / kIndex));
  index["weight_map"]["model.norm.weight"] = "../../etc/passwd";
  write_bytes(c / kIndex, index.dump(2));
  EXPECT_HAS(open_error(c.dir()), (c / kIndex).string() +
                                      ": weight_map['model.norm.weight']: shard \"../../etc/passwd\" is not a "
                                      "file name in the checkpoint directory");
}

TEST(HostileCheckpoint, IndexWithAnEmptyWeightMap) {
  CheckpointCopy c(kFp8);
  write_bytes(c / kIndex, R"({"metadata": {}, "weight_map": {}})");
  EXPECT_HAS(open_error(c.dir()), (c / kIndex).string() + ": weight_map is empty: it names no tensor");
}

TEST(HostileCheckpoint, IndexNumberPastDouble) {
  CheckpointCopy c(kFp8);
  ojson index = ojson::parse(read_bytes(c / kIndex));
  std::string text = index.dump();
  text.replace(text.find("\"metadata\":") + 11, 0, "{\"total_size\": 1e999}, \"x\": ");
  write_bytes(c / kIndex, text);
  EXPECT_HAS(open_error(c.dir()), (c / kIndex).string() + ": invalid JSON");
}

// ---------------------------------------------------------------- fp8 block scales

void set_first_scale(const fs::path& shard, float value, std::string* name) {
  Image img = Image::read(shard);
  for (size_t rank = 0;; ++rank) {
    *name = img.tensor_at(rank);
    if (name->size() > 10 && name->compare(name->size() - 10, 10, "_scale_inv") == 0) break;
  }
  const uint64_t begin = img.header[*name]["data_offsets"][0].get<uint64_t>();
  std::memcpy(img.data.data() + begin + 4, &value, 4);  // the second block: [0, 1]
  img.write(shard);
}

TEST(HostileCheckpoint, NanBlockScale) {
  CheckpointCopy c(kFp8);
  std::string name;
  set_first_scale(c / kFp8Shard, std::numeric_limits<float>::quiet_NaN(), &name);
  EXPECT_HAS(open_error(c.dir()), (c / kFp8Shard).string() + ": tensor '" + name +
                                      "': block scale [0, 1] is nan (shape [1, 2]); every scale must be finite");
}

TEST(HostileCheckpoint, InfBlockScale) {
  CheckpointCopy c(kFp8);
  std::string name;
  set_first_scale(c / kFp8Shard, -std::numeric_limits<float>::infinity(), &name);
  EXPECT_HAS(open_error(c.dir(), WeightPlacement::memory),
             (c / kFp8Shard).string() + ": tensor '" + name + "': block scale [0, 1] is -inf");
}

// ---------------------------------------------------------------- memory limits (--no-mmap)

// Fakes MemAvailable for the loader while in scope.
struct FakeMemAvailable {
  explicit FakeMemAvailable(uint64_t bytes) { set_mem_available_for_testing(bytes); }
  ~FakeMemAvailable() { set_mem_available_for_testing(std::nullopt); }
};

TEST(HostileCheckpoint, NoMmapRefusesACheckpointLargerThanAvailableMemory) {
  CheckpointCopy c(kQlora);
  const uint64_t size = fs::file_size(c / "model.safetensors");
  FakeMemAvailable fake(size - 1);
  EXPECT_HAS(open_error(c.dir(), WeightPlacement::memory),
             (c / "model.safetensors").string() + ": reading it into memory (--no-mmap) needs " +
                 std::to_string(size) + " bytes, but only " + std::to_string(size - 1) +
                 " bytes are available (MemAvailable)");
  // Mapped, the same checkpoint loads: the page cache can evict it.
  EXPECT_EQ(open_error(c.dir(), WeightPlacement::mmap), "(opened)");
}

TEST(HostileCheckpoint, NoMmapCountsEveryShardBeforeReadingAny) {
  CheckpointCopy c(kFp8);
  const uint64_t total = fs::file_size(c / "model-00001-of-00002.safetensors") +
                         fs::file_size(c / "model-00002-of-00002.safetensors");
  {
    // each shard alone fits, both together do not
    FakeMemAvailable fake(total - 1);
    EXPECT_HAS(open_error(c.dir(), WeightPlacement::memory),
               (c / kIndex).string() + ": reading its 2 shards into memory (--no-mmap) needs " +
                   std::to_string(total) + " bytes, but only " + std::to_string(total - 1) + " bytes are available");
  }
  FakeMemAvailable fake(total);
  EXPECT_EQ(open_error(c.dir(), WeightPlacement::memory), "(opened)");
}

// ---------------------------------------------------------------- parsers on raw bytes

TEST(HostileCheckpoint, ParseSafetensorsOnTruncatedImages) {
  // Every prefix of a valid image is refused cleanly (the fuzz target's first property).
  const std::string bytes = read_bytes(kQlora / "model.safetensors");
  for (size_t n : {size_t{0}, size_t{7}, size_t{8}, size_t{100}, size_t{15040 + 8}, bytes.size() - 1}) {
    auto r = parse_safetensors(reinterpret_cast<const std::byte*>(bytes.data()), n, "cut.safetensors");
    EXPECT_FALSE(r.ok()) << n;
    if (!r.ok()) {
      EXPECT_HAS(r.error().message, "cut.safetensors: ");
    }
  }
  auto whole = parse_safetensors(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), "x");
  ASSERT_TRUE(whole.ok()) << whole.error().message;
  EXPECT_EQ(whole.value().size(), 135u);
}

TEST(HostileCheckpoint, ParseShardIndexRefusesNonStringShards) {
  auto r = parse_shard_index(R"({"weight_map": {"a": 3}})", "idx.json");
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.error().message, "idx.json: weight_map['a']: expected a shard file name, got 3");
  auto s = parse_shard_index(R"({"weight_map": {"a": "sub/x.safetensors"}})", "idx.json");
  ASSERT_FALSE(s.ok());
  EXPECT_HAS(s.error().message, "shard \"sub/x.safetensors\" is not a file name");
}

}  // namespace
}  // namespace moat
