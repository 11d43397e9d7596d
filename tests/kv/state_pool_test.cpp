// Recurrent-state slots: whole slots, zeroed when taken, refused when all are in use, and a
// double release fails loudly.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "kv/state_pool.h"

namespace moat {
namespace {

TEST(StateSlotPool, SlotsAreWholeZeroedAndBounded) {
  StateSlotPool pool(3, 1000);
  ASSERT_TRUE(pool.enabled());
  std::set<int32_t> taken;
  for (int i = 0; i < 3; ++i) {
    auto s = pool.allocate();
    ASSERT_TRUE(s.has_value());
    EXPECT_TRUE(taken.insert(*s).second);
    std::fill(pool.data(*s), pool.data(*s) + 1000, 0xab);  // a state written by the model
  }
  EXPECT_FALSE(pool.allocate().has_value()) << "all slots are in use";
  const int32_t back = *taken.begin();
  pool.release(back);
  pool.check_invariants();
  auto again = pool.allocate();
  ASSERT_EQ(again, back) << "the slot just freed is reused";
  EXPECT_EQ(std::count(pool.data(*again), pool.data(*again) + 1000, 0), 1000) << "a reused slot starts zeroed";
  pool.release(*again);
  EXPECT_DEATH(pool.release(*again), "not in use");
}

TEST(StateSlotPool, ZeroBytesIsDisabled) {
  StateSlotPool pool(8, 0);
  EXPECT_FALSE(pool.enabled());
  EXPECT_EQ(pool.num_slots(), 0);
  EXPECT_FALSE(pool.allocate().has_value());
}

}  // namespace
}  // namespace moat

namespace moat {
namespace {

std::vector<uint8_t> state_of(uint8_t fill) { return std::vector<uint8_t>(24, fill); }

// Snapshots hold copies (a later change to the source state does not reach them), restore into
// any buffer, and evict the least recently used, where a restore or a repeated save counts as use.
TEST(StateSnapshotCache, CopiesRestoresAndEvictsTheLeastRecentlyUsed) {
  StateSnapshotCache cache(2, 24);
  ASSERT_TRUE(cache.enabled());
  auto a = state_of(1), b = state_of(2), c = state_of(3);
  cache.save(0xa, a.data());
  cache.save(0xb, b.data());
  a.assign(24, 9);  // the snapshot is a copy
  std::vector<uint8_t> out(24, 0);
  ASSERT_TRUE(cache.restore(0xa, out.data()));  // 0xa now the most recent
  EXPECT_EQ(out, state_of(1));
  cache.save(0xc, c.data());  // evicts 0xb
  EXPECT_TRUE(cache.contains(0xa));
  EXPECT_FALSE(cache.contains(0xb));
  EXPECT_TRUE(cache.contains(0xc));
  EXPECT_FALSE(cache.restore(0xb, out.data()));
  cache.save(0xa, b.data());  // already held: refreshed, not overwritten
  cache.save(0xd, c.data());  // evicts 0xc
  EXPECT_TRUE(cache.contains(0xa));
  EXPECT_FALSE(cache.contains(0xc));
  ASSERT_TRUE(cache.restore(0xa, out.data()));
  EXPECT_EQ(out, state_of(1));
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.counters().evictions, 2);
  EXPECT_EQ(cache.counters().saves, 4);
  EXPECT_EQ(cache.counters().restores, 2);
  cache.check_invariants();
}

TEST(StateSnapshotCache, NoCapacityOrNoStateIsDisabled) {
  StateSnapshotCache none(0, 24), stateless(4, 0);
  EXPECT_FALSE(none.enabled());
  EXPECT_FALSE(stateless.enabled());
  auto s = state_of(1);
  none.save(1, s.data());
  EXPECT_FALSE(none.contains(1));
  none.check_invariants();
}

}  // namespace
}  // namespace moat
