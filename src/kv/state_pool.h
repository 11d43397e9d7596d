// Per-request recurrent-state slots, beside the paged latent cache. An attention layer keeps one
// row per token, in blocks; a linear-attention layer (Kimi Linear's KDA, in the Kimi K3 hybrid;
// ../shared/K3.md) keeps a fixed-size state per request that every token updates in place. Slots
// are whole: one per running request, taken at admission, given back when the request finishes,
// is aborted or is preempted. A preempted request's state goes with its blocks and is rebuilt by
// recomputing the request, so a state never outlives the rows it summarizes.
//
// Prefix caching needs the state at the end of the cached prefix, which the blocks alone do not
// give: StateSnapshotCache keeps copies of states taken at block boundaries, keyed by the prefix
// cache's chain hash of the block that ends there (vLLM's and sglang's approach for Mamba-style
// hybrids). A request then skips the longest cached prefix whose end has a snapshot.
//
// DeepSeek-V3 has no such layer: bytes_per_slot is 0, the pool is disabled and holds nothing.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
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

  // A zero-filled slot (a request's state starts empty), or nullopt when all are in use; with
  // zero_fill false the contents are whatever the slot last held (the caller overwrites them).
  std::optional<int32_t> allocate(bool zero_fill = true);
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

// Copies of recurrent states at block boundaries, least recently used evicted first. The key is
// the prefix cache's chain hash of the last block of the prefix the state summarizes
// (BlockPool::chain_hash), so a hit on the blocks up to that boundary and a snapshot under its
// hash together restore everything a request needs to skip the prefix.
class StateSnapshotCache {
 public:
  // capacity snapshots of bytes_per_state each (either 0: disabled); memory is mapped lazily.
  StateSnapshotCache(int32_t capacity, int64_t bytes_per_state);

  bool enabled() const { return slots_.enabled() && slots_.num_slots() > 0; }
  int32_t capacity() const { return slots_.num_slots(); }
  int32_t size() const { return static_cast<int32_t>(entries_.size()); }
  bool contains(uint64_t hash) const { return entries_.count(hash) > 0; }
  // Stores a copy of `state` under `hash`, evicting the least recently used snapshot when full.
  // A hash already stored is only marked recently used: equal prefixes have equal states.
  void save(uint64_t hash, const uint8_t* state);
  // Copies the snapshot under `hash` into `state` and marks it recently used; false if absent.
  bool restore(uint64_t hash, uint8_t* state);

  struct Counters {
    int64_t saves = 0, restores = 0, evictions = 0;
  };
  const Counters& counters() const { return counters_; }
  // Every entry holds a slot in use, exactly once, and sits once in the recency list.
  void check_invariants() const;

 private:
  struct Entry {
    int32_t slot;
    std::list<uint64_t>::iterator recency;
  };
  StateSlotPool slots_;
  std::list<uint64_t> recency_;  // front: most recently used
  std::unordered_map<uint64_t, Entry> entries_;
  Counters counters_;
};

// How many snapshots a StateSnapshotCache holds when --prefix-state-snapshots is not given.
// Engine::create sizes the cache with it and `moat plan` counts the cache's memory with it, so the
// two agree. Two per running request: room for each one's prompt-end snapshot and its answer's
// latest, what a repeated prompt and a conversation's next turn resume from. The snapshots only
// save recomputation, so they take at most a quarter of leftover_bytes (the memory left after the
// KV cache and the running requests' states; negative: none), leaving the rest to everything else;
// nullopt leftover (memory unknown): no cap. per_state_bytes > 0, per rank under tensor parallelism.
int64_t default_state_snapshots(int64_t max_num_seqs, int64_t per_state_bytes, std::optional<int64_t> leftover_bytes);

}  // namespace moat
