// The planner's catalogs: data/hardware.json (GPUs) and data/models.json (models), both
// user-extendable with --hardware-file / --model-file (an entry with a known id replaces it).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "plan/model_size.h"

namespace moat::plan {

struct HardwareSpec {
  std::string id;    // "b200"
  std::string name;  // "B200"
  std::string vendor;
  double hbm_gb = 0;    // per GPU, 1e9 bytes
  double hbm_tbps = 0;  // HBM bandwidth, 1e12 bytes/s
  double bf16_tflops = 0, fp8_tflops = 0;  // dense
  std::optional<double> fp4_tflops;        // dense; unset when the GPU has no FP4 units
  int64_t gpus_per_node = 8;
  double intra_node_gbps = 0, inter_node_gbps = 0;  // per GPU, GB/s
  double price_per_gpu_hour = 0;                    // USD; --price overrides
  std::vector<std::string> estimated;
  std::string note;
};

// The data directory: $MOAT_HOME/data when MOAT_HOME is set, else <source_dir>/data (the CLI
// passes the source tree it was built from).
std::filesystem::path data_dir(const std::filesystem::path& source_dir);

Result<std::vector<HardwareSpec>> parse_hardware_catalog(const nlohmann::json& j, const std::string& origin);
Result<std::vector<HardwareSpec>> load_hardware_catalog(const std::filesystem::path& file);
Result<std::vector<ModelSize>> parse_model_catalog(const nlohmann::json& j, const std::string& origin);
Result<std::vector<ModelSize>> load_model_catalog(const std::filesystem::path& file);

// Adds `extra` to `base`, replacing entries with the same id.
void merge_hardware(std::vector<HardwareSpec>& base, std::vector<HardwareSpec> extra);
void merge_models(std::vector<ModelSize>& base, std::vector<ModelSize> extra);

// Looks a GPU up by id or name, ignoring case, spaces, '-' and '_' ("B200", "h100-sxm").
// The error lists the known GPUs.
Result<HardwareSpec> find_hardware(const std::vector<HardwareSpec>& catalog, const std::string& name);
// "h200,b200" -> those GPUs, in that order; empty -> the whole catalog.
Result<std::vector<HardwareSpec>> select_hardware(const std::vector<HardwareSpec>& catalog,
                                                  const std::string& comma_list);

// A catalog id/name, else an HF model directory or config.json (sized with load_model_config).
// The error lists the catalog's models.
Result<ModelSize> resolve_model(const std::vector<ModelSize>& catalog, const std::string& name_or_path);

}  // namespace moat::plan
