// Fuzz target: config.json text through parse_model_config, then the derived facts every other
// module computes from an accepted config.
#include <cstddef>
#include <cstdint>

#include "config/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  auto config = moat::parse_model_config(j);
  if (!config.ok()) return 0;
  const moat::ModelConfig& c = config.value();
  volatile double sink = c.softmax_scale() + static_cast<double>(c.qk_head_dim() + c.kv_cache_dim());
  for (int64_t layer = 0; layer < c.num_hidden_layers && layer < 64; ++layer) sink = sink + c.is_moe_layer(layer);
  (void)sink;
  return 0;
}
