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

#include "base/aligned_vector.h"

namespace moat {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// mmap(size, prot, flags, fd at offset 0) at a 2 MiB-aligned address (MAP_FAILED with errno on
// failure). Aligned, an anonymous mapping takes whole huge pages, and a file mapping can take the
// page cache's 2 MiB folios with one page-table entry each (file offsets and addresses agree
// modulo 2 MiB).
void* mmap_huge_aligned(size_t size, int prot, int flags, int fd);

// Resident bytes of the mapping that starts at `start`, and how many of them the kernel maps with
// 2 MiB pages (/proc/self/smaps: Rss, FilePmdMapped + AnonHugePages); zeros where unknown.
struct MappingPageStats {
  size_t resident = 0, huge = 0;
};
MappingPageStats mapping_page_stats(const void* start);

// `bytes` of anonymous memory in a 2 MiB-aligned mapping of its own, advised MADV_HUGEPAGE and left
// untouched (no zero fill: pages are faulted in as they are first written, so filling it from a
// mapped checkpoint while dropping the source's pages never holds both in full). Move-only.
class HugePageBuffer {
 public:
  HugePageBuffer() = default;
  explicit HugePageBuffer(size_t bytes);
  HugePageBuffer(HugePageBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  HugePageBuffer& operator=(HugePageBuffer&& o) noexcept;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;
  ~HugePageBuffer();
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  static size_t mapped_bytes(size_t n) { return (n * sizeof(T) + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes; }

  // Below half a huge page the heap: a mapping of its own would cost a whole huge page of memory.
  // Cache-line aligned there too (CacheLineAllocator): kernels stream rows with 64-byte vector
  // loads, and from a row off a line boundary every one of them touches two lines (see
  // kWeightAlignment in base/weight.h).
  static bool small(size_t n) { return n * sizeof(T) < kHugePageBytes / 2; }

  T* allocate(size_t n) {
    if (n == 0) return nullptr;
    if (small(n)) return CacheLineAllocator<T>().allocate(n);
    const size_t bytes = mapped_bytes(n);
    void* p = mmap_huge_aligned(bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (!p) return;
    if (small(n)) CacheLineAllocator<T>().deallocate(p, n);
    else munmap(p, mapped_bytes(n));
  }
  friend bool operator==(const HugePageAllocator&, const HugePageAllocator&) { return true; }
};

template <class T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace moat
