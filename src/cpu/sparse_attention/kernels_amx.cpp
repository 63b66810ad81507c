// AMX-BF16 attention kernels (bf16 inputs): the pair-layout algorithm of
// kernels_pairs.h with every product on AMX tiles.
#include <immintrin.h>

#include <cstdint>

#include "cpu/isa/amx.h"
#include "cpu/isa/line_drip.h"

namespace dsa::cpu::attention_kernels {
namespace {

using amx::configure_tiles;

// The dkv pass runs a sub-block densely from half its keys listed: measured
// on AMX, where the tiles' products are cheap against gathering entries.
constexpr std::int64_t kDenseSubBlockPercent = 50;

// Tiles 0-3 (rows m, m + 1 x column groups n, n + 1) += A . B over k_chunks
// chunks: A's row tiles at a and a + 16 * a_stride, B's column groups at b and
// b + b_group; the second row / group only where two_m / two_n.
inline void accumulate_tiles(const std::uint16_t* a, int as, std::int64_t a_stride, const std::uint16_t* b, int bs,
                             std::int64_t b_chunk, std::int64_t b_group, std::int64_t k_chunks, bool two_m,
                             bool two_n, LineDrip* drip) {
  for (std::int64_t kc = 0; kc < k_chunks; ++kc) {
    if (drip) drip->step();
    _tile_loadd(4, a + kc * 32, as);
    _tile_loadd(6, b + kc * b_chunk, bs);
    _tile_dpbf16ps(0, 4, 6);
    if (two_n) {
      _tile_loadd(7, b + kc * b_chunk + b_group, bs);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_m) {
      _tile_loadd(5, a + 16 * a_stride + kc * 32, as);
      _tile_dpbf16ps(2, 5, 6);
      if (two_n) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

void tile_gemm2(bool accumulate, float* c, std::int64_t c_stride, std::int64_t m_tiles, std::int64_t n_groups,
                const std::uint16_t* a, std::int64_t a_stride, const std::uint16_t* b, std::int64_t b_stride,
                std::int64_t b_chunk, std::int64_t b_group, std::int64_t k_chunks, std::int64_t n2_groups,
                const std::uint16_t* a2, const std::uint16_t* b2, std::int64_t b2_stride, std::int64_t b2_chunk,
                std::int64_t k2_chunks, LineDrip* drip = nullptr) {
  if (drip) {  // one step per chunk of every 2 x 2 tile block, of both products
    const std::int64_t blocks_m = (m_tiles + 1) / 2;
    std::int64_t steps = 0;
    for (std::int64_t ng = 0; ng < n_groups; ng += 2)
      steps += blocks_m * (k_chunks + (ng < n2_groups ? k2_chunks : 0));
    drip->pace(steps);
  }
  const int cs = static_cast<int>(c_stride * 4), as = static_cast<int>(a_stride * 2), bs = static_cast<int>(b_stride * 2);
  const int b2s = static_cast<int>(b2_stride * 2);
  for (std::int64_t mt = 0; mt < m_tiles; mt += 2) {
    const bool two_m = mt + 1 < m_tiles;
    for (std::int64_t ng = 0; ng < n_groups; ng += 2) {
      const bool two_n = ng + 1 < n_groups;
      float* c00 = c + mt * 16 * c_stride + ng * 16;
      float* c10 = c00 + 16 * c_stride;
      if (accumulate) {
        _tile_loadd(0, c00, cs);
        if (two_n) _tile_loadd(1, c00 + 16, cs);
        if (two_m) _tile_loadd(2, c10, cs);
        if (two_m && two_n) _tile_loadd(3, c10 + 16, cs);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      accumulate_tiles(a + mt * 16 * a_stride, as, a_stride, b + ng * b_group, bs, b_chunk, b_group, k_chunks,
                       two_m, two_n, drip);
      if (ng < n2_groups)
        accumulate_tiles(a2 + mt * 16 * a_stride, as, a_stride, b2 + ng * b_group, b2s, b2_chunk, b_group,
                         k2_chunks, two_m, ng + 1 < n2_groups, drip);
      _tile_stored(0, c00, cs);
      if (two_n) _tile_stored(1, c00 + 16, cs);
      if (two_m) _tile_stored(2, c10, cs);
      if (two_m && two_n) _tile_stored(3, c10 + 16, cs);
    }
  }
}


}  // namespace
}  // namespace dsa::cpu::attention_kernels

#define DSA_PAIR_KERNEL_NAME amx_kernel
#define DSA_PAIR_KERNEL_LABEL "amx"
#include "cpu/sparse_attention/kernels_pairs.h"
