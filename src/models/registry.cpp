#include "models/registry.h"

#include <array>

namespace moat {

namespace {

// Must cover every architecture config/model_config.cpp accepts (tests/models checks both lists).
constexpr std::array<Architecture, 4> kArchitectures = {{
    {"DeepseekV3ForCausalLM", "DeepSeek-V3, V3.1, Kimi K2 (model_type kimi_k2)", &deepseek_v3_weight_spec},
    // V2 differs in config defaults and routing (softmax, greedy / group_limited_greedy), not in
    // tensor layout.
    {"DeepseekV2ForCausalLM", "DeepSeek-V2, V2-Lite", &deepseek_v3_weight_spec},
    {"KimiLinearForCausalLM", "Kimi Linear (model_type kimi_linear: KDA + MLA hybrid)", &kimi_linear_weight_spec},
    {"KimiK3ForConditionalGeneration", "Kimi K3 (its text model; the vision tower is not loaded)",
     &kimi_linear_weight_spec},
}};

}  // namespace

std::span<const Architecture> architectures() { return kArchitectures; }

std::string supported_architectures_list() {
  std::string s;
  for (const Architecture& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

Result<const Architecture*> find_architecture(std::string_view name) {
  for (const Architecture& a : kArchitectures)
    if (a.name == name) return &a;
  return make_error("architecture '{}' is not supported; supported: [{}]", name, supported_architectures_list());
}

Result<WeightSpec> weight_spec_for(const ModelConfig& config) {
  MOAT_ASSIGN_OR_RETURN(const Architecture* arch, find_architecture(config.architecture));
  return arch->weight_spec(config);
}

}  // namespace moat
