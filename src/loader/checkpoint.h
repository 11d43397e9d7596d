// A checkpoint directory as HF writes it: one model.safetensors, or shards listed by
// model.safetensors.index.json ({"weight_map": {tensor name: shard file}}). All shards stay
// mapped for the checkpoint's lifetime; find() returns views into them.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "loader/safetensors.h"

namespace moat {

// model.safetensors.index.json's weight_map as (tensor name, shard file) pairs in file order.
// Refuses what no HF writer produces: a tensor listed twice, a shard that is not a plain file name
// in the checkpoint's directory ("../x", "/etc/x", "a/b"), an empty map. `what` (the index's
// path) names the file in every error. Exposed for the fuzz target.
Result<std::vector<std::pair<std::string, std::string>>> parse_shard_index(std::string_view text,
                                                                           const std::string& what);

// Every F32/BF16/F16 tensor named "*_scale_inv" (fp8 block scales) must be finite: one NaN or
// Inf scale turns a whole 128x128 block of the weight, and every logit after it, into NaN.
// The error names the file, the tensor and the block.
Status check_block_scales(const TensorInfo& t);

class Checkpoint {
 public:
  // DIR holding model.safetensors.index.json (preferred when both exist) or model.safetensors;
  // a path to a single .safetensors file also works.
  // populate = false: map without faulting anything in (a tensor-parallel rank reads its share
  // only, and faults in just those ranges: populate_range).
  static Result<Checkpoint> open(const std::filesystem::path& dir,
                                 WeightPlacement placement = WeightPlacement::mmap, bool populate = true);
  // Mapped checkpoints (WeightPlacement::mmap) only: fault in [p, p + bytes) now (2 MiB pages where
  // the file has them), or drop this process's mapping of the whole pages inside it (release_range:
  // RSS falls; the page cache keeps them, so a later read refaults them cheaply). Never
  // release_range anonymous memory (WeightPlacement::memory): MADV_DONTNEED would zero it.
  static void populate_range(const void* p, size_t bytes);
  static void release_range(const void* p, size_t bytes);

  const TensorInfo* find(std::string_view name) const;
  // Bytes of tensor data over all tensors (what loading the whole checkpoint touches).
  size_t total_bytes() const;
  // Summed over the files (SafetensorsFile::page_stats).
  SafetensorsFile::PageStats page_stats() const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  // The files together take at most 90% of MemAvailable (which counts reclaimable page cache, this
  // checkpoint's own cached pages included): a mapped checkpoint this size can be held resident,
  // faulted in at load or copied into anonymous memory, without evicting its own pages.
  bool fits_in_memory() const;
  const std::filesystem::path& dir() const { return dir_; }
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  static Result<Checkpoint> open_files(const std::filesystem::path& dir, WeightPlacement placement);
  // Mapped checkpoints that fit in the memory available are faulted in at load (populate()), so
  // decode reads them through 2 MiB pages and the first request pays no page faults. Larger ones
  // stay lazy: populating them would evict their own pages.
  void populate_if_it_fits() const;

  std::filesystem::path dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> index_;
};

}  // namespace moat
