// Blocks of the paged latent cache, with reference counts and the prefix cache.
//
// A block holds block_size consecutive tokens of one sequence in every layer. Requests hold
// blocks through their block tables; a block is shared (refcount > 1) only when it is full and
// its tokens were found in the prefix cache, so nobody ever writes into a shared block.
//
// Prefix cache (vLLM's automatic prefix caching, a radix tree at block granularity): a full block
// is registered under hash(parent block's hash, its block_size tokens), so equal hashes mean equal
// whole prefixes. A released block whose refcount drops to 0 keeps its contents and its hash and
// joins the free queue at the back; allocation takes the front (least recently released), which
// evicts that block's hash. A lookup that finds a block in the free queue revives it. The tokens
// of every registered block are kept and compared on a hit, so a 64-bit hash collision can never
// serve the wrong cache rows.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace moat {

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size);

  int32_t num_blocks() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t block_size() const { return block_size_; }
  // Blocks with refcount 0 (free, possibly still holding a cached prefix).
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks() - num_free_; }
  int32_t refcount(int32_t block) const { return refcount_[block]; }

  // A block with refcount 1, or nullopt when every block is referenced (the caller preempts).
  std::optional<int32_t> allocate();
  // Drops one reference; at 0 the block joins the back of the free queue (its cached prefix
  // stays findable until the block is allocated again).
  void release(int32_t block);
  // Appends allocated blocks to `table` until it covers `rows` rows; false when the pool runs
  // out first (the blocks taken so far stay in the table).
  bool extend(std::vector<int32_t>& table, int64_t rows);

  // The hash of a full block whose parent (the block before it in the sequence) hashed to
  // `parent` (0 for the first block).
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);
  // Registers a full block's tokens under `hash` so later requests can share it. A hash that is
  // already registered keeps its first block.
  void register_full(int32_t block, uint64_t hash, std::span<const int32_t> tokens);
  // The cached block for `hash` holding exactly `tokens`, with one more reference; nullopt on a miss.
  std::optional<int32_t> acquire_cached(uint64_t hash, std::span<const int32_t> tokens);
  // Whether acquire_cached would hit; takes nothing and counts nothing.
  bool has_cached(uint64_t hash, std::span<const int32_t> tokens) const;
  // A lookup that missed without calling acquire_cached (the caller decided from has_cached).
  void count_miss() { ++counters_.lookups; }

  struct Counters {
    int64_t lookups = 0, hits = 0;  // blocks asked for / found in the prefix cache
    int64_t evictions = 0;          // cached blocks reallocated for other contents
  };
  const Counters& counters() const { return counters_; }
  // Refcounts agree with the free queue; every registered block's hash maps back to it.
  void check_invariants() const;

 private:
  void unlink_free(int32_t block);
  void push_free_back(int32_t block);
  void forget_hash(int32_t block);

  int32_t block_size_;
  std::vector<int32_t> refcount_;
  // Free queue: an intrusive doubly linked list over block ids (O(1) revive from the middle).
  std::vector<int32_t> prev_, next_;
  int32_t head_ = -1, tail_ = -1, num_free_ = 0;
  std::vector<std::optional<uint64_t>> hash_of_;   // [num_blocks]
  std::vector<int32_t> tokens_;                    // [num_blocks, block_size] of registered blocks
  std::unordered_map<uint64_t, int32_t> cached_;   // hash -> block
  Counters counters_;
};

}  // namespace moat
