// Shared AMX-BF16 building blocks. Include only from *_amx.cpp files (built
// with the AMX flags and called only after run-time detection chose AMX).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/isa/avx512.h"

namespace dsa::cpu::amx {

// Palette 1 with all eight tiles at 16 rows x 64 bytes, the only shape dsa's
// kernels use. Kept in static storage: gcc does not model ldtilecfg as
// reading the whole 64-byte block, so field stores into a stack copy can be
// dropped as dead and the tiles stay unconfigured (SIGILL on first use).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64);
inline constexpr TileConfig kTileConfig{};

// Tile configuration is per thread; every kernel entry sets it.
inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }

using avx512::transpose16x16;

}  // namespace dsa::cpu::amx
