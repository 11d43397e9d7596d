#include "loader/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "base/huge_pages.h"
#include "base/weight.h"

namespace moat {

namespace {

using nlohmann::json;

// A JSON value for an error message, cut short: a hostile header can be 100 MB.
std::string short_dump(const json& v) {
  std::string s = v.dump();
  if (s.size() > 200) s = s.substr(0, 200) + "...";
  return s;
}

std::optional<uint64_t> g_fake_mem_available;  // set_mem_available_for_testing

// numel * elem_size, or nullopt on overflow (a hostile header must not wrap around).
std::optional<uint64_t> checked_bytes(const std::vector<int64_t>& shape, size_t elem_size) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
      return std::nullopt;
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

}  // namespace

uint64_t mem_available_bytes() {
  if (g_fake_mem_available) return *g_fake_mem_available;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    meminfo.ignore(64, '\n');
  }
  return 0;
}

void set_mem_available_for_testing(std::optional<uint64_t> bytes) {
  g_fake_mem_available = bytes;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsFile::~SafetensorsFile() {
  if (alloc_) munmap(alloc_, alloc_size_);
}

bool SafetensorsFile::populate() const {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14; older headers lack the name
#endif
  return alloc_ && madvise(alloc_, alloc_size_, MADV_POPULATE_READ) == 0;
}

SafetensorsFile::PageStats SafetensorsFile::page_stats() const { return mapping_page_stats(alloc_); }

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::open(const std::filesystem::path& path,
                                                                WeightPlacement placement) {
  const std::string file = path.string();
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;

  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error("{}: cannot open: {}", file, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return make_error("{}: cannot stat: {}", file, std::strerror(err));
  }
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return make_error("{}: truncated: {} bytes, expected at least the 8-byte header length", file,
                      f->size_);
  }
  if (placement == WeightPlacement::memory) {
    const uint64_t available = mem_available_bytes();
    if (available > 0 && f->size_ > available) {
      ::close(fd);
      return make_error("{}: reading it into memory (--no-mmap) needs {} bytes, but only {} bytes "
                        "are available (MemAvailable); map it instead (without --no-mmap)",
                        file, f->size_, available);
    }
  }
  void* map = MAP_FAILED;
  if (placement == WeightPlacement::mmap) {
    // MAP_PRIVATE + PROT_READ: the checkpoint is never written through, and pages are shared
    // with the page cache until evicted. The mapping starts on a 2 MiB boundary so that file
    // offsets and addresses agree modulo 2 MiB: only then can the kernel map the page cache's
    // 2 MiB folios (ext4 and xfs have them since Linux 6.16) with one page-table entry each.
    map = mmap_huge_aligned(f->size_, PROT_READ, MAP_PRIVATE, fd);
    const int map_errno = errno;
    ::close(fd);  // the mapping keeps the file alive
    if (map == MAP_FAILED) return make_error("{}: mmap failed: {}", file, std::strerror(map_errno));
    f->alloc_ = map;
    f->alloc_size_ = f->size_;
  } else {
    // The image starts `shift` bytes into the allocation so that the tensor data, which follows
    // the 8-byte length and the header, starts on a cache line (kWeightAlignment): a header padded
    // only to 8 bytes would leave every weight row off one, and a mapped file cannot be moved.
    uint64_t header_len = 0;
    if (::pread(fd, &header_len, 8, 0) != 8) header_len = 0;  // parse_safetensors reports it
    const size_t shift = (kWeightAlignment - (8 + header_len % kWeightAlignment) % kWeightAlignment) % kWeightAlignment;
    f->alloc_size_ = f->size_ + shift;
    void* alloc = mmap_huge_aligned(f->alloc_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    if (alloc == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return make_error("{}: cannot allocate {} bytes to hold it: {}", file, f->size_, std::strerror(err));
    }
    f->alloc_ = alloc;  // unmapped by the destructor from here on
    madvise(alloc, f->alloc_size_, MADV_HUGEPAGE);
    map = static_cast<char*>(alloc) + shift;
    size_t done = 0;
    while (done < f->size_) {
      const ssize_t got = ::pread(fd, static_cast<char*>(map) + done, std::min<size_t>(f->size_ - done, 64u << 20),
                                  static_cast<off_t>(done));
      if (got <= 0) {
        const int err = errno;
        ::close(fd);
        return make_error("{}: read failed at byte {} of {}: {}", file, done, f->size_,
                          got == 0 ? "unexpected end of file" : std::strerror(err));
      }
      done += static_cast<size_t>(got);
    }
    ::close(fd);
    mprotect(alloc, f->alloc_size_, PROT_READ);  // weights are never written, as with the mapping
  }
  f->map_ = map;
  // Decode streams every active weight once per token; with 4 KiB pages that is a TLB miss per
  // page. Asking for huge pages lets kernels with large page-cache folios map 2 MiB at a time
  // (advisory: ignored where unsupported).
  if (placement == WeightPlacement::mmap) madvise(map, f->size_, MADV_HUGEPAGE);

  MOAT_ASSIGN_OR_RETURN(f->tensors_, parse_safetensors(static_cast<const std::byte*>(map), f->size_, file));
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->by_name_.emplace(f->tensors_[i].name, i);
  return f;
}

Result<std::vector<TensorInfo>> parse_safetensors(const std::byte* base, size_t size,
                                                  const std::string& file) {
  if (size < 8)
    return make_error("{}: truncated: {} bytes, expected at least the 8-byte header length", file,
                      size);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i)
    header_len |= static_cast<uint64_t>(static_cast<uint8_t>(base[i])) << (8 * i);
  if (header_len > size - 8)
    return make_error("{}: header length {} runs past the end of the file ({} bytes)", file,
                      header_len, size);
  if (header_len > kMaxSafetensorsHeaderBytes)
    return make_error("{}: header length {} is over the {}-byte limit for a safetensors header",
                      file, header_len, kMaxSafetensorsHeaderBytes);

  // A tensor named twice would leave the bytes of one copy unchecked (nlohmann keeps the last
  // value of a repeated key): the parse callback sees every top-level key.
  std::set<std::string, std::less<>> seen;
  std::string twice;
  const json::parser_callback_t on_key = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string() && twice.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(base + 8),
                         reinterpret_cast<const char*>(base + 8 + header_len), on_key);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e400
    return make_error("{}: invalid header JSON: {}", file, e.what());
  }
  if (!header.is_object())
    return make_error("{}: invalid header JSON: expected an object, got {}", file,
                      header.type_name());
  if (!twice.empty())
    return make_error("{}: tensor '{}' appears twice in the header", file, twice);

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  std::vector<TensorInfo> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    if (!entry.is_object())
      return make_error("{}: tensor '{}': expected an object in the header, got {}", file, name,
                        short_dump(entry));
    TensorInfo t;
    t.name = name;
    t.file = file;

    auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string())
      return make_error("{}: tensor '{}': missing string field 'dtype'", file, name);
    auto dtype = dtype_from_name(dt->get<std::string>());
    if (!dtype)
      return make_error("{}: tensor '{}': unknown dtype \"{}\" (expected one of BF16, F16, F32, "
                        "F8_E4M3, F64, I64, I32, I16, I8, U8, BOOL)",
                        file, name, dt->get<std::string>().substr(0, 64));
    t.dtype = *dtype;

    auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array())
      return make_error("{}: tensor '{}': missing list field 'shape'", file, name);
    for (const auto& d : *sh) {
      // get<int64_t> of an unsigned above INT64_MAX would wrap: such a dim is refused too
      if (!d.is_number_integer() || (d.is_number_unsigned() && d.get<uint64_t>() > INT64_MAX) ||
          d.get<int64_t>() < 0)
        return make_error("{}: tensor '{}': shape {} must hold non-negative integers", file, name,
                          short_dump(*sh));
      t.shape.push_back(d.get<int64_t>());
    }
    // numel() and every product of dims downstream are int64: refuse a shape whose nonzero dims
    // multiply past it, even where a zero dim makes it empty.
    int64_t product = 1;
    for (int64_t d : t.shape)
      if (d != 0 && __builtin_mul_overflow(product, d, &product))
        return make_error("{}: tensor '{}': shape {} has more elements than a 64-bit count holds",
                          file, name, shape_str(t.shape));

    auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2 ||
        !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      return make_error("{}: tensor '{}': 'data_offsets' must be [begin, end] (non-negative "
                        "integers), got {}",
                        file, name, off == entry.end() ? std::string("nothing") : short_dump(*off));
    const uint64_t begin = (*off)[0].get<uint64_t>();
    const uint64_t end = (*off)[1].get<uint64_t>();
    if (begin > end)
      return make_error("{}: tensor '{}': data_offsets [{}, {}] end before they begin", file,
                        name, begin, end);
    if (end > data_size)
      return make_error("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data "
                        "buffer ({} bytes; the file may be truncated)",
                        file, name, begin, end, data_size);
    auto expected = checked_bytes(t.shape, dtype_size(t.dtype));
    if (!expected || *expected != end - begin)
      return make_error("{}: tensor '{}': shape {} of {} needs {} bytes, but data_offsets [{}, "
                        "{}] hold {}",
                        file, name, shape_str(t.shape), dtype_name(t.dtype),
                        expected ? std::to_string(*expected) : std::string("too many"), begin,
                        end, end - begin);
    t.data = base + data_start + begin;
    t.nbytes = static_cast<size_t>(end - begin);
    spans.push_back({begin, end, tensors.size()});
    tensors.push_back(std::move(t));
  }

  // In offset order the tensors must tile the data buffer: each starts where the one before
  // ended (zero-byte tensors occupy nothing), and the last ends at the end of the file.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Span* prev = nullptr;
  uint64_t covered = 0;
  for (const Span& s : spans) {
    if (s.begin == s.end) continue;
    if (prev && s.begin < prev->end)
      return make_error("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap in the data buffer",
                        file, tensors[prev->index].name, prev->begin, prev->end,
                        tensors[s.index].name, s.begin, s.end);
    if (s.begin > covered)
      return make_error("{}: tensor '{}': data_offsets [{}, {}) leave bytes [{}, {}) of the data "
                        "buffer unused{} (safetensors data must be contiguous)",
                        file, tensors[s.index].name, s.begin, s.end, covered, s.begin,
                        prev ? fmt::format(" after '{}'", tensors[prev->index].name) : "");
    covered = s.end;
    prev = &s;
  }
  if (covered != data_size)
    return make_error("{}: the tensors cover {} of the {} bytes of the data buffer: {} bytes "
                      "after {} belong to no tensor",
                      file, covered, data_size, data_size - covered,
                      prev ? fmt::format("'{}'", tensors[prev->index].name) : "the header");

  std::vector<TensorInfo> ordered;
  ordered.reserve(spans.size());
  for (const Span& s : spans) ordered.push_back(std::move(tensors[s.index]));
  return ordered;
}

Status write_safetensors(const std::filesystem::path& path,
                         const std::vector<TensorToWrite>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    auto expected = checked_bytes(t.shape, dtype_size(t.dtype));
    if (!expected || *expected != t.bytes.size())
      return make_error("write_safetensors {}: tensor '{}': shape {} of {} needs {} bytes, got {}",
                        path.string(), t.name, shape_str(t.shape), dtype_name(t.dtype),
                        expected ? std::to_string(*expected) : std::string("too many"),
                        t.bytes.size());
    if (header.contains(t.name))
      return make_error("write_safetensors {}: tensor '{}' given twice", path.string(), t.name);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return make_error("write_safetensors {}: cannot create file", path.string());
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  out.close();
  if (!out) return make_error("write_safetensors {}: write failed", path.string());
  return ok_status();
}

}  // namespace moat
