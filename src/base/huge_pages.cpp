#include "base/huge_pages.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include <fmt/format.h>

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

HugePageBuffer::HugePageBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  p_ = mmap_huge_aligned(bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
  if (p_ == MAP_FAILED) {
    p_ = nullptr;
    throw std::bad_alloc();
  }
  madvise(p_, bytes, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages
}

HugePageBuffer& HugePageBuffer::operator=(HugePageBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) munmap(p_, bytes_);
    p_ = o.p_, bytes_ = o.bytes_;
    o.p_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

HugePageBuffer::~HugePageBuffer() {
  if (p_) munmap(p_, bytes_);
}

MappingPageStats mapping_page_stats(const void* start) {
  if (start == nullptr) return {};
  std::ifstream smaps("/proc/self/smaps");
  const std::string header = fmt::format("{:x}-", reinterpret_cast<uintptr_t>(start));
  std::string line;
  bool inside = false;
  size_t huge_kib = 0, rss_kib = 0;
  while (std::getline(smaps, line)) {
    // a mapping's header line starts with its hex address range; its fields are "Key:  value kB"
    const bool is_header = !line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
                           line.find(':') > line.find(' ');
    if (is_header) {
      if (inside) break;
      inside = line.rfind(header, 0) == 0;
      continue;
    }
    if (!inside) continue;
    for (const char* key : {"FilePmdMapped:", "AnonHugePages:"})
      if (line.rfind(key, 0) == 0) huge_kib += std::strtoull(line.c_str() + std::strlen(key), nullptr, 10);
    if (line.rfind("Rss:", 0) == 0) rss_kib = std::strtoull(line.c_str() + 4, nullptr, 10);
  }
  return {rss_kib * 1024, huge_kib * 1024};
}

}  // namespace moat
