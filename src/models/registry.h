// The model registry: config.json "architectures" -> the architecture's weight table. Loading,
// `moat doctor` and `moat plan` ask it, and an architecture it does not know is refused with the
// list of those it does.
//
// Every registered architecture runs on DeepseekModel, whose layers carry their kind (MLA or
// Kimi Linear's KDA), so an entry names no factory; an architecture that needs its own model
// class adds one here.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "base/status.h"
#include "config/model_config.h"
#include "models/weight_spec.h"

namespace moat {

struct Architecture {
  std::string_view name;     // as in config.json "architectures", e.g. "DeepseekV3ForCausalLM"
  std::string_view models;   // what ships under it, for messages and docs
  WeightSpec (*weight_spec)(const ModelConfig&);
};

std::span<const Architecture> architectures();
// "DeepseekV3ForCausalLM, DeepseekV2ForCausalLM"
std::string supported_architectures_list();
// Errors: "architecture 'X' is not supported; supported: [DeepseekV3ForCausalLM, ...]".
Result<const Architecture*> find_architecture(std::string_view name);
// The weight table of config.architecture for this config.
Result<WeightSpec> weight_spec_for(const ModelConfig& config);

}  // namespace moat
