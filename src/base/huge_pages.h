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

// mmap(size, prot, flags, fd at offset 0) at a 2 MiB-aligned address (MAP_FAILED with errno on
// failure). Aligned, an anonymous mapping takes whole huge pages, and a file mapping can take the
// page cache's 2 MiB folios with one page-table entry each (file offsets and addresses agree
// modulo 2 MiB).
void* mmap_huge_aligned(size_t size, int prot, int flags, int fd);

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
    void* p = mmap_huge_aligned(bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages
    return static_cast<T*>(p);
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
