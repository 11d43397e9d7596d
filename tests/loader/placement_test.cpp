// WeightPlacement::memory must present exactly the bytes WeightPlacement::mmap does, in memory that
// is not the file mapping, and report the same errors for broken files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "loader/checkpoint.h"
#include "loader/safetensors.h"

namespace moat {
namespace {

const std::filesystem::path kRoot = MOAT_SOURCE_DIR;

TEST(WeightPlacement, MemoryHoldsTheSameBytesAsTheMapping) {
  const auto dir = kRoot / "tests/golden/tiny_fp8";  // sharded, fp8 + scales
  auto mapped = Checkpoint::open(dir, WeightPlacement::mmap);
  auto copied = Checkpoint::open(dir, WeightPlacement::memory);
  ASSERT_TRUE(mapped.ok()) << mapped.error().message;
  ASSERT_TRUE(copied.ok()) << copied.error().message;
  ASSERT_EQ(mapped->names(), copied->names());
  for (const std::string& name : mapped->names()) {
    const TensorInfo* a = mapped->find(name);
    const TensorInfo* b = copied->find(name);
    ASSERT_EQ(a->dtype, b->dtype) << name;
    ASSERT_EQ(a->shape, b->shape) << name;
    ASSERT_EQ(a->nbytes, b->nbytes) << name;
    EXPECT_NE(a->data, b->data) << name;
    EXPECT_EQ(std::memcmp(a->data, b->data, a->nbytes), 0) << name;
  }
}

// The mapping starts on a 2 MiB boundary (else no 2 MiB page-cache folio can be mapped whole), the
// small checkpoint was populated at load (every byte resident), and the page statistics read back
// from /proc/self/smaps are consistent.
TEST(WeightPlacement, MappingIsHugePageAlignedAndPopulated) {
  auto ckpt = Checkpoint::open(kRoot / "tests/golden/tiny_fp8", WeightPlacement::mmap);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().message;
  size_t mapped = 0;
  for (const auto& f : ckpt->files()) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f->mapping()) % (uintptr_t{2} << 20), 0u) << f->path();
    const auto s = f->page_stats();
    EXPECT_GE(s.resident, f->file_size() / 4096 * 4096) << f->path() << ": populated at load";
    EXPECT_LE(s.huge, s.resident) << f->path();
    mapped += f->file_size();
  }
  const auto total = ckpt->page_stats();
  EXPECT_GE(total.resident, mapped / 4096 * 4096 - 4096 * ckpt->files().size());
}

// Read into memory, the image starts where its tensor data falls on a cache line: tiny_v2lite's
// header leaves the data 8 bytes past one in the file (and so in the mapping).
TEST(WeightPlacement, MemoryPutsTensorDataOnCacheLines) {
  const auto dir = kRoot / "tests/golden/tiny_v2lite";
  auto mapped = Checkpoint::open(dir, WeightPlacement::mmap);
  auto copied = Checkpoint::open(dir, WeightPlacement::memory);
  ASSERT_TRUE(mapped.ok()) << mapped.error().message;
  ASSERT_TRUE(copied.ok()) << copied.error().message;
  int misaligned_in_file = 0;
  for (const std::string& name : copied->names()) {
    misaligned_in_file += reinterpret_cast<uintptr_t>(mapped->find(name)->data) % 64 != 0;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(copied->find(name)->data) % 64, 0u) << name;
  }
  EXPECT_GT(misaligned_in_file, 0) << "the fixture no longer tests anything";
  for (const auto& f : copied->files()) EXPECT_GT(f->page_stats().resident, 0u) << f->path();
}

TEST(WeightPlacement, MemoryModeReportsTruncatedFiles) {
  const auto path = std::filesystem::temp_directory_path() / "moat_placement_truncated.safetensors";
  {
    std::ofstream out(path, std::ios::binary);
    out.write("\x40\x00\x00", 3);
  }
  auto f = SafetensorsFile::open(path, WeightPlacement::memory);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message.find("truncated"), std::string::npos) << f.error().message;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moat
