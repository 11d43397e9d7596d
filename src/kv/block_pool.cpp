#include "kv/block_pool.h"

#include <algorithm>

#include "base/check.h"

namespace moat {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size),
      refcount_(static_cast<size_t>(num_blocks), 0),
      prev_(static_cast<size_t>(num_blocks), -1),
      next_(static_cast<size_t>(num_blocks), -1),
      hash_of_(static_cast<size_t>(num_blocks)),
      tokens_(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size)) {
  MOAT_CHECK(num_blocks > 0 && block_size > 0, "block pool of {} blocks of {}", num_blocks, block_size);
  for (int32_t b = 0; b < num_blocks; ++b) push_free_back(b);
}

void BlockPool::unlink_free(int32_t b) {
  if (prev_[b] >= 0) next_[prev_[b]] = next_[b]; else head_ = next_[b];
  if (next_[b] >= 0) prev_[next_[b]] = prev_[b]; else tail_ = prev_[b];
  prev_[b] = next_[b] = -1;
  --num_free_;
}

void BlockPool::push_free_back(int32_t b) {
  prev_[b] = tail_;
  next_[b] = -1;
  if (tail_ >= 0) next_[tail_] = b; else head_ = b;
  tail_ = b;
  ++num_free_;
}

void BlockPool::forget_hash(int32_t b) {
  if (!hash_of_[b]) return;
  auto it = cached_.find(*hash_of_[b]);
  if (it != cached_.end() && it->second == b) cached_.erase(it);
  hash_of_[b].reset();
}

bool BlockPool::extend(std::vector<int32_t>& table, int64_t rows) {
  while (static_cast<int64_t>(table.size()) * block_size_ < rows) {
    auto b = allocate();
    if (!b) return false;
    table.push_back(*b);
  }
  return true;
}

std::optional<int32_t> BlockPool::allocate() {
  if (head_ < 0) return std::nullopt;
  const int32_t b = head_;
  unlink_free(b);
  if (hash_of_[b]) ++counters_.evictions;
  forget_hash(b);
  refcount_[b] = 1;
  return b;
}

void BlockPool::release(int32_t b) {
  MOAT_CHECK(b >= 0 && b < num_blocks() && refcount_[b] > 0, "release of block {} with refcount {}", b,
             b >= 0 && b < num_blocks() ? refcount_[b] : -1);
  if (--refcount_[b] == 0) push_free_back(b);
}

uint64_t BlockPool::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  // FNV-1a over the parent hash and the token ids, then a final avalanche (splitmix64).
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(parent);
  for (int32_t t : tokens) mix(static_cast<uint32_t>(t));
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

void BlockPool::register_full(int32_t b, uint64_t hash, std::span<const int32_t> tokens) {
  MOAT_CHECK(static_cast<int32_t>(tokens.size()) == block_size_, "registering {} tokens in a block of {}",
             tokens.size(), block_size_);
  MOAT_CHECK(refcount_[b] > 0, "registering free block {}", b);
  if (hash_of_[b] || cached_.count(hash)) return;
  hash_of_[b] = hash;
  cached_.emplace(hash, b);
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<int64_t>(b) * block_size_);
}

std::optional<int32_t> BlockPool::acquire_cached(uint64_t hash, std::span<const int32_t> tokens) {
  ++counters_.lookups;
  auto it = cached_.find(hash);
  if (it == cached_.end()) return std::nullopt;
  const int32_t b = it->second;
  if (!std::equal(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<int64_t>(b) * block_size_))
    return std::nullopt;
  if (refcount_[b] == 0) unlink_free(b);
  ++refcount_[b];
  ++counters_.hits;
  return b;
}

bool BlockPool::has_cached(uint64_t hash, std::span<const int32_t> tokens) const {
  auto it = cached_.find(hash);
  return it != cached_.end() &&
         std::equal(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<int64_t>(it->second) * block_size_);
}

void BlockPool::check_invariants() const {
  int32_t n = 0;
  for (int32_t b = head_, prev = -1; b >= 0; prev = b, b = next_[b]) {
    MOAT_CHECK(refcount_[b] == 0, "block {} in the free queue with refcount {}", b, refcount_[b]);
    MOAT_CHECK(prev_[b] == prev, "free queue links broken at block {}", b);
    MOAT_CHECK(++n <= num_blocks(), "free queue has a cycle");
  }
  MOAT_CHECK(n == num_free_, "free queue holds {} blocks, counter says {}", n, num_free_);
  const auto zero = std::count(refcount_.begin(), refcount_.end(), 0);
  MOAT_CHECK(zero == num_free_, "{} blocks have refcount 0 but {} are free", zero, num_free_);
  for (const auto& [hash, b] : cached_)
    MOAT_CHECK(hash_of_[b] && *hash_of_[b] == hash, "cached hash does not map back to block {}", b);
}

}  // namespace moat
