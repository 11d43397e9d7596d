// CPU backend registration. SIMD kernels (AVX-512 BF16 / AVX2, runtime feature dispatch) register
// here; until an op has one, the cpu backend resolves it to the reference kernel as a declared
// Fallback, which `moat doctor` shows.
#include "ops/registry.h"

namespace moat::ops {

void register_cpu_kernels(Registry& registry) {}

}  // namespace moat::ops
