// Fuzz target: model.safetensors.index.json text through parse_shard_index.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "loader/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto entries = moat::parse_shard_index(std::string_view(reinterpret_cast<const char*>(data), size),
                                         "fuzz/model.safetensors.index.json");
  if (!entries.ok()) return 0;
  for (const auto& [name, shard] : entries.value())
    if (shard.empty() || shard.find('/') != std::string::npos) __builtin_trap();
  return 0;
}
