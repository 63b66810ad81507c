// Shared AMX-BF16 building blocks. Include only from *_amx.cpp files (built
// with the AMX flags and called only after run-time detection chose AMX).
#pragma once

#include <immintrin.h>

#include <cstdint>

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

// In-register transpose of a 16 x 16 block of 32-bit elements: r[i][j] <- r[j][i].
// Pure data movement, so it serves fp32 values and bf16 pairs (AMX's VNNI layout) alike.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + j] now holds, in each 128-bit lane L, element j of rows 4q..4q+3 for
  // columns 4L + j; two rounds of 128-bit shuffles gather lanes across row quads.
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

}  // namespace dsa::cpu::amx
