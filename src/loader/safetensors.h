// One .safetensors file, memory-mapped read-only: tensors point straight into the mapping, so a
// checkpoint costs page cache, not heap. The file format: an 8-byte little-endian header length
// N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
// then the data buffer that the offsets index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/huge_pages.h"
#include "base/status.h"

namespace moat {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // inside the mapping; valid while the file is open
  size_t nbytes = 0;
  std::string file;  // path of the .safetensors file, for error messages

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// "[2048, 512]": how shapes appear in every loader message.
std::string shape_str(const std::vector<int64_t>& shape);

// Where tensor bytes live once a file is open.
//  mmap:   mapped read-only from the page cache; nothing is copied (the default).
//  memory: read once into anonymous, huge-page-advised memory. Costs a read of the file at load
//          and the same RSS; 2 MiB pages whatever state the page cache is in (a mapping gets them
//          only where the page cache holds 2 MiB folios: see populate()).
enum class WeightPlacement { mmap, memory };

// MemAvailable of /proc/meminfo in bytes (0 when unknown): what WeightPlacement::memory may
// take. A checkpoint larger than this is refused at open with both numbers instead of being
// read until the OOM killer ends the process. Tests fake the figure with
// set_mem_available_for_testing (nullopt goes back to /proc/meminfo).
uint64_t mem_available_bytes();
void set_mem_available_for_testing(std::optional<uint64_t> bytes);

class SafetensorsFile {
 public:
  // Maps the file and checks the header against the file size. Every error names the file, and
  // the tensor when one is at fault.
  static Result<std::shared_ptr<SafetensorsFile>> open(const std::filesystem::path& path,
                                                        WeightPlacement placement = WeightPlacement::mmap);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // In data-offset (file) order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view name) const;
  size_t file_size() const { return size_; }
  // Start of the read-only mapping ([mapping(), mapping() + file_size())): every tensor's data
  // lies inside it.
  const std::byte* mapping() const { return static_cast<const std::byte*>(map_); }
  const std::filesystem::path& path() const { return path_; }
  // Resident bytes of the mapping, and how many of them the kernel maps with 2 MiB pages
  // (/proc/self/smaps: Rss, FilePmdMapped + AnonHugePages); zeros where unknown. Decode streams
  // every weight once per token, so 4 KiB pages cost a TLB miss per page.
  using PageStats = MappingPageStats;
  PageStats page_stats() const;
  // Faults the whole mapping in now (MADV_POPULATE_READ, Linux 5.14+; false where refused).
  // Sequential faults let the page cache read the file in 2 MiB folios (ext4 and xfs since
  // Linux 6.16), which the 2 MiB-aligned mapping then maps whole; lazy faults in layer and
  // expert order mostly get small folios.
  bool populate() const;

 private:
  SafetensorsFile() = default;

  std::filesystem::path path_;
  void* map_ = nullptr;  // the file's first byte
  size_t size_ = 0;
  void* alloc_ = nullptr;  // the mapping that holds it (--no-mmap: the image starts a few bytes in)
  size_t alloc_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index in tensors_
};

// The largest JSON header accepted (the limit of the reference implementation, huggingface/
// safetensors): a longer one is refused before it is parsed.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and checks a whole safetensors image [base, base + size): the 8-byte header length, the
// JSON header and the data buffer, which the tensors must cover exactly, in order, without gaps
// or overlaps (the format's rule, so no byte is left unaccounted for). What open() runs on the
// mapping, and what the fuzz target runs on its input. Tensors come back in data-offset order,
// pointing into the image; `file` names the file in every error.
Result<std::vector<TensorInfo>> parse_safetensors(const std::byte* base, size_t size,
                                                  const std::string& file);

// A tensor for write_safetensors: bytes must hold exactly numel * dtype_size bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// Writes tensors in the given order (tests and tools make small checkpoints with it). The
// header is padded with spaces to a multiple of 8 bytes, as the reference writer does, so the
// data buffer starts 8-byte aligned.
Status write_safetensors(const std::filesystem::path& path,
                         const std::vector<TensorToWrite>& tensors);

}  // namespace moat
