#include "base/huge_pages.h"

#include <cerrno>

namespace moat {

void* mmap_huge_aligned(size_t size, int prot, int flags, int fd) {
  // Reserve size + 2 MiB of address space, map at the first aligned address inside it, and release
  // the slack on both sides.
  void* reserved =
      mmap(nullptr, size + kHugePageBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return MAP_FAILED;
  const auto begin = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  void* map = mmap(reinterpret_cast<void*>(aligned), size, prot, flags | MAP_FIXED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    munmap(reserved, size + kHugePageBytes);
    errno = err;
    return MAP_FAILED;
  }
  if (aligned > begin) munmap(reserved, aligned - begin);
  const uintptr_t end = aligned + ((size + 4095) & ~size_t{4095});
  if (begin + size + kHugePageBytes > end) munmap(reinterpret_cast<void*>(end), begin + size + kHugePageBytes - end);
  return map;
}

}  // namespace moat
