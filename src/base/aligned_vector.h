// Cache-line aligned vectors for kernels' scratch buffers (staged weights, packed activations,
// accumulators). std::vector's memory is 16-byte aligned, so rows read by 64-byte vector loads or
// AMX tile loads straddle two lines each. On AMX a 16-row tile load off line boundaries took twice as
// long: Intel Xeon VM (Emerald Rapids-class, 2026-12-05), strips of a 1408 x 2048 bf16 matrix
// against 48 tokens, x's tiles 16 bytes off a line 574 GFLOPS with the weights in L2, on lines 1074-1375.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace moat {

inline constexpr std::size_t kCacheLineBytes = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{kCacheLineBytes}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace moat
