// AMX-BF16 score kernel of the fused indexer (bf16 inputs): the algorithm of
// score_pairs.h with its products on AMX tiles.
#include <immintrin.h>

#include <cstdint>

#include "cpu/isa/amx.h"

namespace dsa::cpu::indexer_kernels {
namespace {

using amx::configure_tiles;

// The product contract of score_pairs.h ("Products"): C tiles 0-3 over the
// chunks, A tiles 4-5, B tiles 6-7.
inline void score_block(const std::uint16_t* a0, const std::uint16_t* a1, int q_stride, const std::uint32_t* b,
                        std::int64_t b_chunk, std::int64_t chunks, bool pair, float* cbuf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::uint32_t* bc = b + c * b_chunk;
    _tile_loadd(6, bc, 64);
    _tile_loadd(7, bc + 256, 64);
    _tile_loadd(4, a0 + c * 32, q_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (pair) {
      _tile_loadd(5, a1 + c * 32, q_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf + 0 * 256, 64);
  _tile_stored(1, cbuf + 1 * 256, 64);
  if (pair) {
    _tile_stored(2, cbuf + 2 * 256, 64);
    _tile_stored(3, cbuf + 3 * 256, 64);
  }
}

}  // namespace
}  // namespace dsa::cpu::indexer_kernels

#define DSA_SCORE_KERNEL_NAME amx_kernel
#define DSA_SCORE_KERNEL_LABEL "amx"
#include "cpu/score/score_pairs.h"
