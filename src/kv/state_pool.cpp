#include "kv/state_pool.h"

#include <atomic>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include "base/check.h"

namespace moat {

StateSlotPool::StateSlotPool(int32_t num_slots, int64_t bytes_per_slot) : bytes_per_slot_(bytes_per_slot) {
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id.fetch_add(1);
  MOAT_CHECK(num_slots >= 0 && bytes_per_slot >= 0, "state pool of {} slots x {} bytes", num_slots, bytes_per_slot);
  if (!enabled()) return;
  in_use_.assign(static_cast<size_t>(num_slots), false);
  for (int32_t s = num_slots - 1; s >= 0; --s) free_.push_back(s);
  bytes_ = static_cast<int64_t>(num_slots) * bytes_per_slot;
  if (bytes_ == 0) return;
  void* p = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  MOAT_CHECK(p != MAP_FAILED, "cannot map {} bytes for {} state slots", bytes_, num_slots);
  base_ = static_cast<uint8_t*>(p);
}

StateSlotPool::~StateSlotPool() {
  if (base_) munmap(base_, static_cast<size_t>(bytes_));
}

std::optional<int32_t> StateSlotPool::allocate(bool zero_fill) {
  if (free_.empty()) return std::nullopt;
  const int32_t s = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(s)] = true;
  if (zero_fill) std::memset(data(s), 0, static_cast<size_t>(bytes_per_slot_));
  return s;
}

void StateSlotPool::acquire(int32_t slot) {
  MOAT_CHECK(enabled() && slot >= 0 && slot < num_slots(), "acquiring state slot {} of {}", slot, num_slots());
  if (!in_use_[static_cast<size_t>(slot)]) {
    std::erase(free_, slot);
    in_use_[static_cast<size_t>(slot)] = true;
  }
  std::memset(data(slot), 0, static_cast<size_t>(bytes_per_slot_));
}

void StateSlotPool::release(int32_t slot) {
  MOAT_CHECK(slot >= 0 && slot < num_slots() && in_use_[static_cast<size_t>(slot)], "releasing state slot {} not in use",
             slot);
  in_use_[static_cast<size_t>(slot)] = false;
  free_.push_back(slot);
}

uint8_t* StateSlotPool::data(int32_t slot) {
  MOAT_CHECK(slot >= 0 && slot < num_slots() && in_use_[static_cast<size_t>(slot)], "state slot {} not in use", slot);
  return base_ + static_cast<int64_t>(slot) * bytes_per_slot_;
}

void StateSlotPool::check_invariants() const {
  int32_t used = 0;
  for (bool u : in_use_) used += u;
  MOAT_CHECK(used + num_free() == num_slots(), "{} slots in use + {} free != {}", used, num_free(), num_slots());
  for (int32_t s : free_) MOAT_CHECK(!in_use_[static_cast<size_t>(s)], "free slot {} marked in use", s);
}

StateSnapshotCache::StateSnapshotCache(int32_t capacity, int64_t bytes_per_state)
    : slots_(bytes_per_state > 0 ? capacity : 0, bytes_per_state) {}

void StateSnapshotCache::save(uint64_t hash, const uint8_t* state) {
  if (!enabled()) return;
  if (auto it = entries_.find(hash); it != entries_.end()) {
    recency_.splice(recency_.begin(), recency_, it->second.recency);
    return;
  }
  std::optional<int32_t> slot = slots_.allocate(/*zero_fill=*/false);
  if (!slot) {
    const uint64_t victim = recency_.back();
    recency_.pop_back();
    auto it = entries_.find(victim);
    slots_.release(it->second.slot);
    entries_.erase(it);
    ++counters_.evictions;
    slot = slots_.allocate(/*zero_fill=*/false);
  }
  std::memcpy(slots_.data(*slot), state, static_cast<size_t>(slots_.bytes_per_slot()));
  recency_.push_front(hash);
  entries_.emplace(hash, Entry{*slot, recency_.begin()});
  ++counters_.saves;
}

bool StateSnapshotCache::restore(uint64_t hash, uint8_t* state) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return false;
  std::memcpy(state, slots_.data(it->second.slot), static_cast<size_t>(slots_.bytes_per_slot()));
  recency_.splice(recency_.begin(), recency_, it->second.recency);
  ++counters_.restores;
  return true;
}

void StateSnapshotCache::check_invariants() const {
  slots_.check_invariants();
  MOAT_CHECK(recency_.size() == entries_.size(), "{} snapshots but {} in the recency list", entries_.size(),
             recency_.size());
  MOAT_CHECK(static_cast<int32_t>(entries_.size()) + slots_.num_free() == slots_.num_slots(),
             "{} snapshots + {} free slots != {}", entries_.size(), slots_.num_free(), slots_.num_slots());
  std::vector<bool> seen(static_cast<size_t>(slots_.num_slots()), false);
  for (const auto& [hash, e] : entries_) {
    MOAT_CHECK(*e.recency == hash, "snapshot {:x} points at another recency entry", hash);
    MOAT_CHECK(slots_.in_use(e.slot) && !seen[static_cast<size_t>(e.slot)], "snapshot slot {} free or shared", e.slot);
    seen[static_cast<size_t>(e.slot)] = true;
  }
}

int64_t default_state_snapshots(int64_t max_num_seqs, int64_t per_state_bytes, std::optional<int64_t> leftover_bytes) {
  MOAT_CHECK(max_num_seqs >= 0 && per_state_bytes > 0, "snapshots for {} requests of {} bytes of state", max_num_seqs,
             per_state_bytes);
  const int64_t wanted = 2 * max_num_seqs;
  if (!leftover_bytes) return wanted;
  return std::min(wanted, std::max<int64_t>(0, *leftover_bytes / 4 / per_state_bytes));
}

}  // namespace moat
