// realign_weights moves exactly the matrices that start off a cache line into one aligned arena,
// byte for byte, each source once (matrices may share one), and releases each source after copying.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <numeric>
#include <vector>

#include "base/weight.h"

namespace moat {
namespace {

// Bytes 0, 1, 2, ... in memory aligned to 64, so offsets choose the alignment exactly.
struct Pattern {
  explicit Pattern(size_t n) : bytes(n + 64) {
    std::iota(bytes.begin(), bytes.end(), uint8_t{0});
    base = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
  }
  HugePageVector<uint8_t> bytes;
  uint8_t* base;
};

TEST(RealignWeights, CopiesOnlyMisalignedMatricesAndReleasesEachSourceOnce) {
  Pattern p(1 << 20);
  const WeightMatrix bf16{.dtype = DType::BF16, .data = p.base + 8, .out_features = 3, .in_features = 64};
  const WeightMatrix aligned{.dtype = DType::BF16, .data = p.base + 4096, .out_features = 2, .in_features = 32};
  alignas(64) static const float scales[1] = {0.5f};  // on a line, but its matrix moves: it moves too
  const WeightMatrix fp8{.dtype = DType::F8_E4M3, .data = p.base + 8192 + 24, .out_features = 5, .in_features = 40,
                         .scale_inv = scales};
  // 4-bit: codes and group scales, both off a line
  const WeightMatrix q4 = WeightMatrix::packed_4bit(DType::MXFP4, p.base + 16384 + 40, p.base + 32768 + 3, 4, 64);

  WeightMatrix a = bf16, b = bf16, c = aligned, d = fp8, e = q4;
  std::map<const void*, size_t> released;
  HugePageBuffer arena;
  const int64_t copied = realign_weights({&a, &b, &c, &d, nullptr, &e}, arena, [&](const void* src, size_t n) {
    EXPECT_EQ(released.count(src), 0u) << "released twice";
    released[src] = n;
  });
  // bf16 3x64x2 = 384, fp8 5x40 = 200 -> 256 and its one scale 4 -> 64, 4-bit codes 4x32 = 128,
  // scales 4x2 = 8 -> 64
  EXPECT_EQ(copied, 384 + 256 + 64 + 128 + 64);
  EXPECT_EQ(static_cast<int64_t>(arena.size()), copied);
  for (const WeightMatrix* w : {&a, &d, &e}) EXPECT_TRUE(weight_aligned(w->data));
  EXPECT_TRUE(weight_aligned(e.group_scales));
  EXPECT_EQ(a.data, b.data) << "one copy for matrices sharing a source";
  EXPECT_EQ(c.data, aligned.data) << "an aligned matrix stays";
  EXPECT_NE(d.scale_inv, scales) << "fp8 scales move with their codes";
  EXPECT_EQ(d.scale_inv[0], 0.5f);
  EXPECT_TRUE(weight_aligned(d.scale_inv));
  EXPECT_EQ(std::memcmp(a.data, bf16.data, 384), 0);
  EXPECT_EQ(std::memcmp(d.data, fp8.data, 200), 0);
  EXPECT_EQ(std::memcmp(e.data, q4.data, 128), 0);
  EXPECT_EQ(std::memcmp(e.group_scales, q4.group_scales, 8), 0);
  const std::map<const void*, size_t> expected = {
      {bf16.data, 384}, {fp8.data, 200}, {scales, 4}, {q4.data, 128}, {q4.group_scales, 8}};
  EXPECT_EQ(released, expected);
}

// Scales on a line still move when their matrix moves (read in place, a mapped checkpoint's pages
// come back), and stay when it stays.
TEST(RealignWeights, ScalesFollowTheirMatrix) {
  Pattern p(1 << 20);
  const WeightMatrix moved = WeightMatrix::packed_4bit(DType::INT4_G32, p.base + 8, p.base + 4096, 4, 64);
  const WeightMatrix stays = WeightMatrix::packed_4bit(DType::INT4_G32, p.base + 8192, p.base + 12288, 4, 64);
  WeightMatrix a = moved, b = stays;
  HugePageBuffer arena;
  std::map<const void*, size_t> released;
  // codes 4x32 = 128, bf16 scales 4x2x2 = 16 -> 64
  EXPECT_EQ(realign_weights({&a, &b}, arena, [&](const void* src, size_t n) { released[src] = n; }), 128 + 64);
  EXPECT_NE(a.group_scales, moved.group_scales);
  EXPECT_EQ(std::memcmp(a.group_scales, moved.group_scales, 16), 0);
  EXPECT_EQ(b.data, stays.data);
  EXPECT_EQ(b.group_scales, stays.group_scales);
  const std::map<const void*, size_t> expected = {{moved.data, 128}, {moved.group_scales, 16}};
  EXPECT_EQ(released, expected);
}

TEST(RealignWeights, AllAlignedCopiesNothing) {
  Pattern p(1 << 16);
  WeightMatrix w{.dtype = DType::BF16, .data = p.base + 128, .out_features = 4, .in_features = 64};
  HugePageBuffer arena;
  int releases = 0;
  EXPECT_EQ(realign_weights({&w}, arena, [&](const void*, size_t) { ++releases; }), 0);
  EXPECT_EQ(arena.size(), 0u);
  EXPECT_EQ(releases, 0);
  EXPECT_EQ(w.data, p.base + 128);
}

TEST(RealignWeights, SmallHeapAllocationsAreCacheLineAligned) {
  // HugePageVector's heap path (under 1 MiB) holds absorbed per-head MLA matrices: decode streams them.
  for (size_t n : {1, 100, 4096, 100000}) {
    HugePageVector<uint16_t> v(n);
    EXPECT_TRUE(weight_aligned(v.data())) << n;
  }
}

}  // namespace
}  // namespace moat
