// Fuzz target: a whole .safetensors image (8-byte length, JSON header, data buffer) through the
// loader's parser. Every tensor it accepts must lie inside the input: its first and last bytes
// are read (ASan reports a read outside), and block scales are checked as Checkpoint::open does.
#include <cstddef>
#include <cstdint>

#include "loader/checkpoint.h"
#include "loader/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* base = reinterpret_cast<const std::byte*>(data);
  auto tensors = moat::parse_safetensors(base, size, "fuzz.safetensors");
  if (!tensors.ok()) return 0;
  volatile uint8_t sink = 0;
  for (const moat::TensorInfo& t : tensors.value()) {
    if (t.nbytes == 0) continue;
    if (t.data < base || t.data + t.nbytes > base + size) __builtin_trap();
    if (static_cast<uint64_t>(t.numel()) * moat::dtype_size(t.dtype) != t.nbytes) __builtin_trap();
    sink = sink ^ static_cast<uint8_t>(t.data[0]) ^ static_cast<uint8_t>(t.data[t.nbytes - 1]);
    (void)moat::check_block_scales(t);
  }
  return 0;
}
