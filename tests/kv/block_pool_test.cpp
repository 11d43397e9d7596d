#include <gtest/gtest.h>

#include <numeric>

#include "kv/block_pool.h"
#include "kv/latent_cache.h"

namespace moat {
namespace {

std::vector<int32_t> iota_tokens(int32_t n, int32_t start) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(BlockPool, AllocatesEveryBlockOnceThenRefuses) {
  BlockPool pool(4, 16);
  std::vector<int32_t> got;
  for (int i = 0; i < 4; ++i) {
    auto b = pool.allocate();
    ASSERT_TRUE(b);
    got.push_back(*b);
  }
  EXPECT_FALSE(pool.allocate());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.num_free(), 0);
  pool.release(got[2]);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.allocate(), got[2]);
  pool.check_invariants();
}

TEST(BlockPool, ReleasingAFreeBlockIsAnInvariantViolation) {
  BlockPool pool(2, 4);
  auto b = pool.allocate();
  pool.release(*b);
  EXPECT_DEATH(pool.release(*b), "refcount");
}

TEST(BlockPool, PrefixBlocksAreSharedAndSurviveRelease) {
  BlockPool pool(4, 4);
  const auto tokens = iota_tokens(4, 100);
  const uint64_t h = BlockPool::chain_hash(0, tokens);
  const int32_t b = *pool.allocate();
  pool.register_full(b, h, tokens);
  // Another request with the same first block shares it.
  auto hit = pool.acquire_cached(h, tokens);
  ASSERT_TRUE(hit);
  EXPECT_EQ(*hit, b);
  EXPECT_EQ(pool.refcount(b), 2);
  pool.release(b);
  pool.release(b);
  EXPECT_EQ(pool.num_free(), 4);
  // Free but still cached: a later request revives it.
  hit = pool.acquire_cached(h, tokens);
  ASSERT_TRUE(hit);
  EXPECT_EQ(*hit, b);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.counters().hits, 2);
  pool.check_invariants();
}

TEST(BlockPool, SameHashWithOtherTokensIsAMiss) {
  BlockPool pool(2, 4);
  const auto tokens = iota_tokens(4, 0);
  const int32_t b = *pool.allocate();
  pool.register_full(b, 42, tokens);  // as if two contents hashed alike
  EXPECT_FALSE(pool.acquire_cached(42, iota_tokens(4, 1)));
  EXPECT_TRUE(pool.acquire_cached(42, tokens));
}

TEST(BlockPool, AllocationEvictsTheLeastRecentlyReleasedCachedBlock) {
  BlockPool pool(2, 2);
  const auto ta = iota_tokens(2, 0), tb = iota_tokens(2, 10);
  const uint64_t ha = BlockPool::chain_hash(0, ta), hb = BlockPool::chain_hash(0, tb);
  const int32_t a = *pool.allocate(), b = *pool.allocate();
  pool.register_full(a, ha, ta);
  pool.register_full(b, hb, tb);
  pool.release(a);  // a first: it is the older free block
  pool.release(b);
  EXPECT_EQ(pool.allocate(), a);  // evicts a's prefix
  EXPECT_EQ(pool.counters().evictions, 1);
  EXPECT_FALSE(pool.acquire_cached(ha, ta));
  EXPECT_TRUE(pool.acquire_cached(hb, tb));
  pool.check_invariants();
}

TEST(BlockPool, ChainHashDependsOnTheParent) {
  const auto t = iota_tokens(4, 7);
  EXPECT_NE(BlockPool::chain_hash(0, t), BlockPool::chain_hash(1, t));
  EXPECT_EQ(BlockPool::chain_hash(5, t), BlockPool::chain_hash(5, t));
}

TEST(LatentCache, BytesPerTokenAndRowsByDtype) {
  EXPECT_EQ((LatentCacheShape{61, 576, DType::BF16}.bytes_per_token()), 61 * 576 * 2);  // DeepSeek-V3: 70,272
  EXPECT_EQ((LatentCacheShape{61, 576, DType::F8_E4M3}.bytes_per_token()), 61 * (576 + 4));
  EXPECT_EQ((LatentCacheShape{2, 8, DType::F32}.bytes_per_token()), 2 * 8 * 4);
  PagedLatentCache cache({2, 8, DType::BF16}, 3, 4);
  EXPECT_EQ(cache.layer(1).block_size, 4);
  EXPECT_EQ(cache.layer(0).row_scale, nullptr);
  PagedLatentCache fp8({2, 8, DType::F8_E4M3}, 3, 4);
  EXPECT_NE(fp8.layer(1).row_scale, nullptr);
  EXPECT_TRUE(parse_kv_dtype("fp8").ok());
  EXPECT_FALSE(parse_kv_dtype("int4").ok());
  EXPECT_NE(parse_kv_dtype("int4").error().message.find("--kv-dtype"), std::string::npos);
}

}  // namespace
}  // namespace moat
