#include "plan/catalog.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>

namespace moat::plan {

using nlohmann::json;
namespace fs = std::filesystem;

fs::path data_dir(const fs::path& source_dir) {
  if (const char* home = std::getenv("MOAT_HOME"); home && *home) return fs::path(home) / "data";
  return source_dir / "data";
}

namespace {

Result<json> read_json(const fs::path& file, const char* what) {
  std::ifstream in(file);
  if (!in)
    return make_error("{} {}: cannot open (set $MOAT_HOME to the moat tree, or pass the file explicitly)",
                      what, file.string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error("{} {}: not valid JSON", what, file.string());
  return j;
}

// Lower case with spaces, '-' and '_' removed, so "H100 SXM", "h100-sxm" and "h100sxm" agree.
std::string key(const std::string& s) {
  std::string out;
  for (char c : s)
    if (c != ' ' && c != '-' && c != '_') out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return out;
}

Result<double> field(const json& e, const std::string& where, const char* name, bool allow_zero = false) {
  auto it = e.find(name);
  if (it == e.end()) return make_error("{}: field '{}' is missing", where, name);
  if (!it->is_number()) return make_error("{}: field '{}': expected a number, got {}", where, name, it->dump());
  const double v = it->get<double>();
  if (allow_zero ? v < 0 : !(v > 0))
    return make_error("{}: field '{}': expected {} 0, got {}", where, name, allow_zero ? ">=" : ">", v);
  return v;
}

std::string known_list(const std::vector<std::string>& ids) {
  std::string s;
  for (const auto& id : ids) s += (s.empty() ? "" : ", ") + id;
  return s;
}

}  // namespace

Result<std::vector<HardwareSpec>> parse_hardware_catalog(const json& j, const std::string& origin) {
  if (!j.is_object() || !j.contains("gpus") || !j["gpus"].is_array())
    return make_error("{}: expected an object with a 'gpus' array", origin);
  std::vector<HardwareSpec> out;
  for (const json& e : j["gpus"]) {
    if (!e.is_object() || !e.contains("id") || !e["id"].is_string())
      return make_error("{}: every GPU needs a string 'id'", origin);
    HardwareSpec h;
    h.id = e["id"].get<std::string>();
    const std::string where = fmt::format("{}: GPU '{}'", origin, h.id);
    h.name = e.value("name", h.id);
    h.vendor = e.value("vendor", "");
    MOAT_ASSIGN_OR_RETURN(h.hbm_gb, field(e, where, "hbm_gb"));
    MOAT_ASSIGN_OR_RETURN(h.hbm_tbps, field(e, where, "hbm_tbps"));
    MOAT_ASSIGN_OR_RETURN(h.bf16_tflops, field(e, where, "bf16_tflops"));
    MOAT_ASSIGN_OR_RETURN(h.fp8_tflops, field(e, where, "fp8_tflops"));
    if (e.contains("fp4_tflops") && !e["fp4_tflops"].is_null()) {
      MOAT_ASSIGN_OR_RETURN(double fp4, field(e, where, "fp4_tflops"));
      h.fp4_tflops = fp4;
    }
    MOAT_ASSIGN_OR_RETURN(double per_node, field(e, where, "gpus_per_node"));
    h.gpus_per_node = static_cast<int64_t>(per_node);
    if (h.gpus_per_node != per_node) return make_error("{}: field 'gpus_per_node': expected an integer", where);
    MOAT_ASSIGN_OR_RETURN(h.intra_node_gbps, field(e, where, "intra_node_gbps"));
    MOAT_ASSIGN_OR_RETURN(h.inter_node_gbps, field(e, where, "inter_node_gbps"));
    MOAT_ASSIGN_OR_RETURN(h.price_per_gpu_hour, field(e, where, "price_per_gpu_hour", true));
    if (e.contains("estimated") && e["estimated"].is_array())
      for (const auto& f : e["estimated"])
        if (f.is_string()) h.estimated.push_back(f.get<std::string>());
    h.note = e.value("note", "");
    out.push_back(std::move(h));
  }
  return out;
}

Result<std::vector<HardwareSpec>> load_hardware_catalog(const fs::path& file) {
  MOAT_ASSIGN_OR_RETURN(json j, read_json(file, "hardware catalog"));
  return parse_hardware_catalog(j, file.string());
}

Result<std::vector<ModelSize>> parse_model_catalog(const json& j, const std::string& origin) {
  if (!j.is_object() || !j.contains("models") || !j["models"].is_array())
    return make_error("{}: expected an object with a 'models' array", origin);
  std::vector<ModelSize> out;
  for (const json& e : j["models"]) {
    auto m = size_from_catalog_entry(e);
    if (!m) return make_error("{}: {}", origin, m.error().message);
    out.push_back(std::move(m).value());
  }
  return out;
}

Result<std::vector<ModelSize>> load_model_catalog(const fs::path& file) {
  MOAT_ASSIGN_OR_RETURN(json j, read_json(file, "model catalog"));
  return parse_model_catalog(j, file.string());
}

void merge_hardware(std::vector<HardwareSpec>& base, std::vector<HardwareSpec> extra) {
  for (auto& h : extra) {
    auto it = std::find_if(base.begin(), base.end(), [&](const auto& b) { return key(b.id) == key(h.id); });
    if (it != base.end()) *it = std::move(h);
    else base.push_back(std::move(h));
  }
}

void merge_models(std::vector<ModelSize>& base, std::vector<ModelSize> extra) {
  for (auto& m : extra) {
    auto it = std::find_if(base.begin(), base.end(), [&](const auto& b) { return key(b.id) == key(m.id); });
    if (it != base.end()) *it = std::move(m);
    else base.push_back(std::move(m));
  }
}

Result<HardwareSpec> find_hardware(const std::vector<HardwareSpec>& catalog, const std::string& name) {
  const std::string k = key(name);
  for (const auto& h : catalog)
    if (key(h.id) == k || key(h.name) == k) return h;
  std::vector<std::string> ids;
  for (const auto& h : catalog) ids.push_back(h.id);
  return make_error("--hardware: unknown GPU '{}'; known: {} (add others with --hardware-file)", name,
                    known_list(ids));
}

Result<std::vector<HardwareSpec>> select_hardware(const std::vector<HardwareSpec>& catalog,
                                                  const std::string& comma_list) {
  if (comma_list.empty()) return catalog;
  std::vector<HardwareSpec> out;
  size_t start = 0;
  while (start <= comma_list.size()) {
    size_t end = comma_list.find(',', start);
    if (end == std::string::npos) end = comma_list.size();
    std::string item = comma_list.substr(start, end - start);
    if (item.empty()) return make_error("--hardware: empty name in '{}'", comma_list);
    MOAT_ASSIGN_OR_RETURN(HardwareSpec h, find_hardware(catalog, item));
    out.push_back(std::move(h));
    start = end + 1;
  }
  return out;
}

Result<ModelSize> resolve_model(const std::vector<ModelSize>& catalog, const std::string& name_or_path) {
  if (name_or_path.empty()) return make_error("--model: expected a catalog name or an HF model directory");
  const std::string k = key(name_or_path);
  for (const auto& m : catalog)
    if (key(m.id) == k || key(m.name) == k) return m;
  std::error_code ec;
  if (fs::exists(name_or_path, ec)) {
    auto config = load_model_config(name_or_path);
    if (!config) return make_error("--model {}: {}", name_or_path, config.error().message);
    fs::path p(name_or_path);
    std::string name = fs::is_directory(p, ec) ? p.filename().string() : p.parent_path().filename().string();
    if (name.empty()) name = name_or_path;
    return size_from_config(*config, name_or_path, name);
  }
  std::vector<std::string> ids;
  for (const auto& m : catalog) ids.push_back(m.id);
  return make_error("--model: '{}' is neither a catalog model ({}) nor an existing directory or config.json",
                    name_or_path, known_list(ids));
}

}  // namespace moat::plan
