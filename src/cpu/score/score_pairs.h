// Score kernel of the fused indexer on bf16 pairs (bf16 inputs), shared by
// score_amx.cpp (products on AMX tiles) and score_avx512bf16.cpp (the same
// products on vdpbf16ps). The engine defines, before including this file,
// inside dsa::cpu::indexer_kernels' anonymous namespace:
//   void configure_tiles();  per-thread set-up at every kernel entry
//   void score_block(...);   the product below ("Products")
// and names the kernel through DSA_SCORE_KERNEL_NAME / DSA_SCORE_KERNEL_LABEL.
//
// The query block is packed to bf16 [tokens][Hpad][Dpad] (heads padded to 16,
// dims to 32, zeros), so each (token, 16-head group, 32-dim chunk) is one A
// tile. Each key tile of 32 keys is repacked into the VNNI pair layout AMX
// wants for B (two 16-key tiles per 32-dim chunk). C tiles hold 16 heads x 16
// keys; the ReLU and the weighted head sum run on them in AVX-512 registers.
//
// Products: score_block(a0, a1, q_stride, b, b_chunk, chunks, pair, cbuf)
// writes the C tiles [16 heads][16 keys] fp32 (row stride 16):
//   cbuf + 0   = A0 . B0,   cbuf + 256 = A0 . B1,
//   cbuf + 512 = A1 . B0,   cbuf + 768 = A1 . B1   (only where pair)
// with A0 / A1 the 16 head rows at a0 / a1 (row stride q_stride bytes, chunk c
// at + 32c elements) and B0 / B1 the key-group tiles at b + c * b_chunk and
// + 256 (u32 elements, rows of 16 keys x one dim pair), over `chunks` chunks.
#include <immintrin.h>

#include <cstring>

#include "cpu/score/score_kernels.h"
#include "cpu/isa/avx512.h"

namespace dsa::cpu::indexer_kernels {
namespace {

using avx512::transpose16x16;

constexpr std::int64_t kTileRows = 16;
constexpr std::int64_t kChunk = 32;  // bf16 elements in one 64-byte tile row
constexpr std::int64_t kGroups = kKeyTile / 16;  // 16-key B tiles per key tile

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// Where the A tiles of a query block live: straight in the caller's tensor
// when heads fill 16-row tiles, dims fill 32-wide chunks and rows sit on cache
// lines, else in a zero-padded copy after this header.
struct QueryTiles {
  const std::uint16_t* base;
  std::int64_t token_stride, head_stride;  // elements
};
constexpr std::size_t kQueryHeader = 64;

std::size_t pair_packed_query_bytes(std::int64_t heads, std::int64_t dim) {
  return kQueryHeader +
         static_cast<std::size_t>(kQueryBlock * round_up(heads, kTileRows) * round_up(dim, kChunk)) * 2;
}

std::size_t pair_key_scratch_bytes(std::int64_t dim) {
  // VNNI B tiles (one per 16 keys and chunk) followed by four fp32 C tiles for the epilogue.
  return static_cast<std::size_t>(round_up(dim, kChunk) / kChunk) * kGroups * 1024 + 4 * 1024 + 64;
}

void pair_pack_queries(const QueryBlockSource& src, void* packed) {
  auto* tiles = static_cast<QueryTiles*>(packed);
  const auto* q = static_cast<const std::uint16_t*>(src.query);
  // Direct loads only when every tile row is a whole cache line: a row split
  // across two lines doubles the load traffic and costs more than the copy.
  const bool lines_aligned = reinterpret_cast<std::uintptr_t>(q) % 64 == 0 &&
                             src.row_stride % kChunk == 0 && src.head_stride % kChunk == 0;
  if (src.heads % kTileRows == 0 && src.dim % kChunk == 0 && lines_aligned) {
    *tiles = {q, src.row_stride, src.head_stride};
    return;
  }
  const std::int64_t hpad = round_up(src.heads, kTileRows), dpad = round_up(src.dim, kChunk);
  auto* out = reinterpret_cast<std::uint16_t*>(static_cast<char*>(packed) + kQueryHeader);
  *tiles = {out, hpad * dpad, dpad};
  for (std::int64_t t = 0; t < src.tokens; ++t)
    for (std::int64_t h = 0; h < hpad; ++h) {
      std::uint16_t* dst = out + (t * hpad + h) * dpad;
      if (h < src.heads) {
        std::memcpy(dst, q + t * src.row_stride + h * src.head_stride, src.dim * 2);
        std::memset(dst + src.dim, 0, (dpad - src.dim) * 2);
      } else {
        std::memset(dst, 0, dpad * 2);
      }
    }
}

// B tile (chunk c, key group n): row r holds keys n*16 .. n*16+15, each as the pair
// of dims (c*32 + 2r, c*32 + 2r + 1). A full tile is a 16x16 transpose of the
// keys' 32-bit dim pairs; partial tiles take the scalar path with zero fill.
void pack_keys_vnni(const KeyTileSource& keys, std::int64_t dim, std::uint32_t* vnni) {
  const std::int64_t chunks = round_up(dim, kChunk) / kChunk;
  const auto* k = static_cast<const std::uint16_t*>(keys.keys);
  if (keys.count == kKeyTile && dim % kChunk == 0) {
    for (std::int64_t half = 0; half < kGroups; ++half)
      for (std::int64_t c = 0; c < chunks; ++c) {
        __m512i r[16];
        for (int col = 0; col < 16; ++col)
          r[col] = _mm512_loadu_si512(k + (half * 16 + col) * keys.row_stride + c * kChunk);
        transpose16x16(r);
        std::uint32_t* tile = vnni + (c * kGroups + half) * 256;
        for (int row = 0; row < 16; ++row) _mm512_store_si512(tile + row * 16, r[row]);
      }
    return;
  }
  std::memset(vnni, 0, chunks * kGroups * 1024);
  for (std::int64_t s = 0; s < keys.count; ++s) {
    const std::uint16_t* row = k + s * keys.row_stride;
    const std::int64_t half = s / 16, col = s % 16;
    for (std::int64_t d = 0; d + 1 < dim; d += 2) {
      std::uint32_t pair;
      std::memcpy(&pair, row + d, 4);
      const std::int64_t c = d / kChunk, r = (d % kChunk) / 2;
      vnni[((c * kGroups + half) * 16 + r) * 16 + col] = pair;
    }
    if (dim % 2) {
      const std::int64_t d = dim - 1, c = d / kChunk, r = (d % kChunk) / 2;
      vnni[((c * kGroups + half) * 16 + r) * 16 + col] = row[d];
    }
  }
}

inline __m512 relu_keep_nan(__m512 x, __m512 zero) {
  return _mm512_max_ps(zero, x);  // vmaxps returns its second operand when either is NaN
}

void pair_score_tile(const void* packed, const QueryBlockSource& shape, const float* weights,
                    const KeyTileSource& keys, void* key_scratch, float* out) {
  const std::int64_t hpad = round_up(shape.heads, kTileRows), dpad = round_up(shape.dim, kChunk);
  const std::int64_t chunks = dpad / kChunk, groups = hpad / kTileRows;
  auto* vnni = static_cast<std::uint32_t*>(key_scratch);
  float* cbuf = reinterpret_cast<float*>(
      (reinterpret_cast<std::uintptr_t>(vnni + chunks * kGroups * 256) + 63) & ~std::uintptr_t(63));
  pack_keys_vnni(keys, shape.dim, vnni);
  configure_tiles();
  const QueryTiles tiles = *static_cast<const QueryTiles*>(packed);
  const __m512 zero = _mm512_setzero_ps();
  const int q_stride = static_cast<int>(tiles.head_stride * 2);

  // Per token: for each pair of 16-head groups, the 64 keys in two passes of
  // 32, so the pair's A tiles (from the L2-resident query block) are reused
  // from L1 on the second pass.
  for (std::int64_t t = 0; t < shape.tokens; ++t) {
    __m512 acc[kGroups];
    for (auto& a : acc) a = zero;
    const float* w = weights + t * shape.heads;
    for (std::int64_t g = 0; g < groups; g += 2) {
      const bool pair = g + 1 < groups;
      const std::uint16_t* a0 = tiles.base + t * tiles.token_stride + g * kTileRows * tiles.head_stride;
      const std::uint16_t* a1 = a0 + kTileRows * tiles.head_stride;
      for (std::int64_t pass = 0; pass < kGroups / 2; ++pass) {
        score_block(a0, a1, q_stride, vnni + 2 * pass * 256, kGroups * 256, chunks, pair, cbuf);
        __m512 acc_lo = acc[2 * pass], acc_hi = acc[2 * pass + 1];
        for (int part = 0; part < (pair ? 2 : 1); ++part) {
          const std::int64_t h0 = (g + part) * kTileRows;
          const float* c0 = cbuf + (2 * part) * 256;
          const float* c1 = c0 + 256;
          const std::int64_t rows = shape.heads - h0 < kTileRows ? shape.heads - h0 : kTileRows;
          for (std::int64_t r = 0; r < rows; ++r) {
            const __m512 wr = _mm512_set1_ps(w[h0 + r]);
            acc_lo = _mm512_fmadd_ps(wr, relu_keep_nan(_mm512_load_ps(c0 + r * 16), zero), acc_lo);
            acc_hi = _mm512_fmadd_ps(wr, relu_keep_nan(_mm512_load_ps(c1 + r * 16), zero), acc_hi);
          }
        }
        acc[2 * pass] = acc_lo;
        acc[2 * pass + 1] = acc_hi;
      }
    }
    for (std::int64_t n = 0; n < kGroups; ++n) _mm512_storeu_ps(out + t * kKeyTile + n * 16, acc[n]);
  }
}

}  // namespace

const ScoreKernel& DSA_SCORE_KERNEL_NAME() {
  static const ScoreKernel kernel{DSA_SCORE_KERNEL_LABEL, pair_packed_query_bytes, pair_key_scratch_bytes,
                                  pair_pack_queries, pair_score_tile};
  return kernel;
}

}  // namespace dsa::cpu::indexer_kernels
