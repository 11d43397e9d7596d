// Per-request recurrent-state slots, beside the paged latent cache. An attention layer keeps one
// row per token, in blocks; a linear-attention layer (Kimi Linear's KDA, in the Kimi K3 hybrid;
// ../shared/K3.md) keeps a fixed-size state per request that every token updates in place. Slots
// are whole: one per running request, taken at admission, given back when the request finishes,
// is aborted or is preempted. A preempted request's state goes with its blocks and is rebuilt by
// recomputing the request, so a state never outlives the rows it summarizes; for the same reason
// a model with state cannot skip a prefix through the prefix cache (the state of the prefix is
// not stored), and the scheduler takes no prefix hits for it.
//
// DeepSeek-V3 has no such layer: bytes_per_slot is 0, the pool is disabled and holds nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace moat {

class StateSlotPool {
 public:
  // num_slots slots of bytes_per_slot each (0: disabled); memory is mapped lazily.
  StateSlotPool(int32_t num_slots, int64_t bytes_per_slot);
  ~StateSlotPool();
  StateSlotPool(const StateSlotPool&) = delete;
  StateSlotPool& operator=(const StateSlotPool&) = delete;

  bool enabled() const { return bytes_per_slot_ > 0; }
  int32_t num_slots() const { return static_cast<int32_t>(in_use_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int64_t bytes_per_slot() const { return bytes_per_slot_; }

  // A zero-filled slot (a request's state starts empty), or nullopt when all are in use.
  std::optional<int32_t> allocate();
  // Takes this particular slot, zero-filled, whether or not it was in use: a tensor-parallel
  // worker's mirror of rank 0's pool, told which slot a new sequence starts in.
  void acquire(int32_t slot);
  // Unique per pool made in this process (tensor-parallel workers mirror rank 0's pools by it).
  uint64_t id() const { return id_; }
  void release(int32_t slot);
  bool in_use(int32_t slot) const { return in_use_.at(static_cast<size_t>(slot)); }
  // [bytes_per_slot] of a slot in use.
  uint8_t* data(int32_t slot);
  // The free list and the in-use flags agree.
  void check_invariants() const;

 private:
  int64_t bytes_per_slot_;
  uint64_t id_ = 0;
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  std::vector<int32_t> free_;  // a stack: the most recently freed slot is reused first (warm pages)
  std::vector<bool> in_use_;
};

}  // namespace moat
