// An allocator for weights moat builds at load time (the absorbed MLA matrices): memory in
// 2 MiB-aligned anonymous mappings marked MADV_HUGEPAGE, as the mmapped checkpoint's weights are.
// Decode streams these every step; from the heap (4 KiB pages where transparent huge pages are
// `madvise` only, Debian's default) every 4 KiB of a row stream cost a TLB miss and a restarted
// hardware prefetch stream.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace moat {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  static size_t mapped_bytes(size_t n) { return (n * sizeof(T) + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes; }

  // Below half a huge page the heap: a mapping of its own would cost a whole huge page of memory.
  static bool small(size_t n) { return n * sizeof(T) < kHugePageBytes / 2; }

  T* allocate(size_t n) {
    if (n == 0) return nullptr;
    if (small(n)) return static_cast<T*>(::operator new(n * sizeof(T)));
    const size_t bytes = mapped_bytes(n);
    // Over-map by one huge page, then unmap what lies outside the aligned range.
    void* raw = mmap(nullptr, bytes + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t tail = start + bytes + kHugePageBytes - (aligned + bytes);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages
    return reinterpret_cast<T*>(aligned);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (!p) return;
    if (small(n)) ::operator delete(p);
    else munmap(p, mapped_bytes(n));
  }
  friend bool operator==(const HugePageAllocator&, const HugePageAllocator&) { return true; }
};

template <class T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace moat
