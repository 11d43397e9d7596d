#include "loader/checkpoint.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace moat {

namespace {
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
}  // namespace

Result<Checkpoint> Checkpoint::open(const std::filesystem::path& dir, WeightPlacement placement) {
  MOAT_ASSIGN_OR_RETURN(Checkpoint ckpt, open_files(dir, placement));
  if (placement == WeightPlacement::mmap) ckpt.populate_if_it_fits();
  return ckpt;
}

void Checkpoint::populate_if_it_fits() const {
  size_t mapped = 0;
  for (const auto& f : files_) mapped += f->file_size();
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t available_kib = 0, value = 0;
  while (meminfo >> key >> value) {
    if (key == "MemAvailable:") available_kib = value;
    meminfo.ignore(64, '\n');
  }
  // MemAvailable counts reclaimable page cache, the checkpoint's own cached pages included
  if (mapped / 1024 > available_kib / 10 * 9) return;
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
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::parse_error& e) {
      return make_error("{}: invalid JSON: {}", index_path.string(), e.what());
    }
    auto wm = index.is_object() ? index.find("weight_map") : index.end();
    if (wm == index.end() || !wm->is_object())
      return make_error("{}: expected an object field 'weight_map' (tensor name -> shard file)",
                        index_path.string());

    // Open each shard once, in order of first mention.
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [name, shard] : wm->items()) {
      if (!shard.is_string())
        return make_error("{}: weight_map['{}']: expected a shard file name, got {}",
                          index_path.string(), name, shard.dump());
      const std::string shard_name = shard.get<std::string>();
      if (shards.count(shard_name)) continue;
      const fs::path shard_path = dir / shard_name;
      if (!fs::exists(shard_path, ec))
        return make_error("{}: shard '{}' (holding '{}') is missing from {}",
                          index_path.string(), shard_name, name, dir.string());
      MOAT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(shard_path, placement));
      shards.emplace(shard_name, file);
      ckpt.files_.push_back(std::move(file));
    }
    for (const auto& [name, shard] : wm->items()) {
      const std::string shard_name = shard.get<std::string>();
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
