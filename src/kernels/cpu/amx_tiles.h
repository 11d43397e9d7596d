// AMX tile state, shared by the AMX matmul (matmul_avx512bf16.cpp) and bench/'s tile peak probe.
// Every user configures all eight tiles as 16 rows x 64 bytes. Tile configuration is per thread
// and keeps thousands of bytes of XSAVE state live until released, so a TileScope holds it only
// for one pool task or one probe loop. Only where ops::cpu_has_isa("amx-bf16"), which has asked
// Linux for the tile state.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moat::ops::amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

class TileScope {
 public:
  // The configuration is a static, not a local: GCC 12's _tile_loadconfig does not tell the
  // compiler it reads the 64 bytes, and the stores of a local configuration were deleted (the
  // first tilezero then faulted).
  __attribute__((target("amx-tile"))) TileScope() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  __attribute__((target("amx-tile"))) ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace moat::ops::amx
