#include "loader/checkpoint.h"

#include <sys/mman.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace moat {

namespace {
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
}  // namespace

Result<std::vector<std::pair<std::string, std::string>>> parse_shard_index(std::string_view text,
                                                                           const std::string& what) {
  using nlohmann::json;
  // nlohmann keeps the last value of a repeated key: the callback sees every weight_map key.
  std::string top_key, twice;
  std::set<std::string, std::less<>> seen;
  const json::parser_callback_t on_key = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event != json::parse_event_t::key || !parsed.is_string()) return true;
    if (depth == 1) top_key = parsed.get<std::string>();
    if (depth == 2 && top_key == "weight_map" && twice.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  json index;
  try {
    index = json::parse(text.begin(), text.end(), on_key);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e400
    return make_error("{}: invalid JSON: {}", what, e.what());
  }
  auto wm = index.is_object() ? index.find("weight_map") : index.end();
  if (wm == index.end() || !wm->is_object())
    return make_error("{}: expected an object field 'weight_map' (tensor name -> shard file)",
                      what);
  if (!twice.empty())
    return make_error("{}: weight_map lists tensor '{}' twice", what, twice);
  if (wm->empty()) return make_error("{}: weight_map is empty: it names no tensor", what);
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(wm->size());
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) {
      std::string got = shard.dump();
      if (got.size() > 200) got = got.substr(0, 200) + "...";
      return make_error("{}: weight_map['{}']: expected a shard file name, got {}", what, name,
                        got);
    }
    const std::string file = shard.get<std::string>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\0') != std::string::npos)
      return make_error("{}: weight_map['{}']: shard \"{}\" is not a file name in the checkpoint "
                        "directory",
                        what, name, file);
    out.emplace_back(name, file);
  }
  return out;
}

Status check_block_scales(const TensorInfo& t) {
  constexpr std::string_view kSuffix = "_scale_inv";
  if (t.name.size() < kSuffix.size() ||
      t.name.compare(t.name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
    return ok_status();
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16) return ok_status();
  const size_t n = t.nbytes / dtype_size(t.dtype);
  for (size_t i = 0; i < n; ++i) {
    float v;
    if (t.dtype == DType::F32) {
      std::memcpy(&v, t.data + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * i, 2);
      v = t.dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    if (std::isfinite(v)) continue;
    // the block's coordinates, e.g. [3, 17] of a [ceil(out/128), ceil(in/128)] grid
    std::vector<int64_t> at(t.shape.size());
    size_t rest = i;
    for (size_t d = t.shape.size(); d-- > 0;) {
      at[d] = static_cast<int64_t>(rest % static_cast<size_t>(t.shape[d]));
      rest /= static_cast<size_t>(t.shape[d]);
    }
    return make_error("{}: tensor '{}': block scale {} is {} (shape {}); every scale must be finite",
                      t.file, t.name, shape_str(at), v, shape_str(t.shape));
  }
  return ok_status();
}

Result<Checkpoint> Checkpoint::open(const std::filesystem::path& dir, WeightPlacement placement, bool populate) {
  MOAT_ASSIGN_OR_RETURN(Checkpoint ckpt, open_files(dir, placement));
  for (const auto& file : ckpt.files_)
    for (const auto& t : file->tensors()) MOAT_TRY(check_block_scales(t));
  if (placement == WeightPlacement::mmap && populate) ckpt.populate_if_it_fits();
  return ckpt;
}

void Checkpoint::populate_range(const void* p, size_t bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // Linux 5.14; older headers lack the name
#endif
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) & ~(page - 1);
  if (bytes > 0) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);  // a hint: errors ignored
}

void Checkpoint::release_range(const void* p, size_t bytes) {
  // whole pages inside the range only: a neighbour's page stays mapped
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

bool Checkpoint::fits_in_memory() const {
  size_t mapped = 0;
  for (const auto& f : files_) mapped += f->file_size();
  return mapped <= mem_available_bytes() / 10 * 9;
}

void Checkpoint::populate_if_it_fits() const {
  if (!fits_in_memory()) return;
  for (const auto& f : files_) f->populate();
}

Result<Checkpoint> Checkpoint::open_files(const std::filesystem::path& dir, WeightPlacement placement) {
  namespace fs = std::filesystem;
  std::error_code ec;
  Checkpoint ckpt;
  ckpt.dir_ = dir;

  // A single file given directly.
  if (fs::is_regular_file(dir, ec) && dir.extension() == ".safetensors") {
    MOAT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(dir, placement));
    for (const auto& t : file->tensors()) ckpt.index_.emplace(t.name, &t);
    ckpt.files_.push_back(std::move(file));
    ckpt.dir_ = dir.parent_path();
    return ckpt;
  }

  const fs::path index_path = dir / kIndexFile;
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    if (!in) return make_error("{}: cannot open", index_path.string());
    std::stringstream text;
    text << in.rdbuf();
    MOAT_ASSIGN_OR_RETURN(const auto entries, parse_shard_index(text.str(), index_path.string()));

    // Every shard is checked to exist, and (--no-mmap) the shards together to fit in memory,
    // before any is read.
    std::vector<std::string> shard_names;  // in order of first mention
    std::set<std::string, std::less<>> listed;
    uint64_t total = 0;
    for (const auto& [name, shard_name] : entries) {
      if (!listed.insert(shard_name).second) continue;
      const fs::path shard_path = dir / shard_name;
      if (!fs::is_regular_file(shard_path, ec))
        return make_error("{}: shard '{}' (holding '{}') is missing from {}",
                          index_path.string(), shard_name, name, dir.string());
      total += fs::file_size(shard_path, ec);
      shard_names.push_back(shard_name);
    }
    if (placement == WeightPlacement::memory) {
      const uint64_t available = mem_available_bytes();
      if (available > 0 && total > available)
        return make_error("{}: reading its {} shards into memory (--no-mmap) needs {} bytes, but only "
                          "{} bytes are available (MemAvailable); map them instead (without --no-mmap)",
                          index_path.string(), shard_names.size(), total, available);
    }
    std::map<std::string, std::shared_ptr<SafetensorsFile>, std::less<>> shards;
    for (const std::string& shard_name : shard_names) {
      MOAT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(dir / shard_name, placement));
      shards.emplace(shard_name, file);
      ckpt.files_.push_back(std::move(file));
    }
    for (const auto& [name, shard_name] : entries) {
      const TensorInfo* t = shards.at(shard_name)->find(name);
      if (!t)
        return make_error("{}: tensor '{}' is mapped to shard '{}', which does not contain it",
                          index_path.string(), name, shard_name);
      ckpt.index_.emplace(name, t);
    }
    // Tensors a shard holds beyond the index (rare: hand-edited indexes) stay reachable; the
    // index decides when a name is in two shards.
    for (const auto& file : ckpt.files_)
      for (const auto& t : file->tensors()) ckpt.index_.emplace(t.name, &t);
    return ckpt;
  }

  const fs::path single = dir / kSingleFile;
  if (fs::exists(single, ec)) {
    MOAT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(single, placement));
    for (const auto& t : file->tensors()) ckpt.index_.emplace(t.name, &t);
    ckpt.files_.push_back(std::move(file));
    return ckpt;
  }
  return make_error("{}: no checkpoint: expected {} or {} in this directory", dir.string(),
                    kSingleFile, kIndexFile);
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

size_t Checkpoint::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, t] : index_) total += t->nbytes;
  return total;
}

SafetensorsFile::PageStats Checkpoint::page_stats() const {
  SafetensorsFile::PageStats total;
  for (const auto& f : files_) {
    const auto s = f->page_stats();
    total.resident += s.resident;
    total.huge += s.huge;
  }
  return total;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, t] : index_) out.push_back(name);
  return out;
}

}  // namespace moat
