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
