// The vdpbf16ps product engine: C (+)= A . B on bf16 pairs with fp32
// accumulation, for CPUs with AVX-512-BF16 but no AMX (Zen 4, Zen 5, Cooper
// Lake). Include only from *_avx512bf16.cpp files.
//
// The operands keep the AMX tile layouts, so what a kernel packs for tiles
// serves here as it is: a B tile row is one zmm (16 columns x one pair of
// contraction indices) and an A element pair is one 32-bit broadcast
// (vpbroadcastd from memory), shared by the N column groups of its row. A
// register block of R C rows x N column groups of 16 stays in zmm accumulators
// over the whole contraction; R x N is 16 accumulators (12 for N = 3): enough
// independent chains to hide vdpbf16ps's latency, with room for the N B rows.
//
// Every C element is accumulated chunk by chunk, pair by pair, in contraction
// order, so the blocking never changes the bits: a kernel gives the same
// results whichever row or column split it uses.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/isa/line_drip.h"

namespace dsa::cpu::avx512bf16 {
namespace {  // internal linkage, as line_drip.h's LineDrip that PairGemm holds

// Element offsets (bf16 elements for A and B, floats for C) of one product.
//   A: row i, contraction chunk kc (32 bf16 = 16 pairs) at a + i * a_stride + kc * a_chunk
//   B: chunk kc, column group j (16 columns), pair p at b + kc * b_chunk + j * b_group + p * b_stride
//   C: row i, column group j at c + i * c_stride + j * c_group
struct PairGemm {
  float* c;
  std::int64_t c_stride, c_group;
  const std::uint16_t* a;
  std::int64_t a_stride, a_chunk;
  const std::uint16_t* b;
  std::int64_t b_stride, b_chunk, b_group;
  std::int64_t k_chunks;
  // Lines to ask for while the product runs (line_drip.h): one step per
  // contraction chunk of a register block.
  LineDrip* drip = nullptr;
};

// Packed B tiles are kept as u32 pairs; the engine addresses them in bf16 elements.
inline const std::uint16_t* as_bf16(const std::uint32_t* pairs) { return reinterpret_cast<const std::uint16_t*>(pairs); }

namespace detail {

constexpr int rows_for(int n) { return n >= 3 ? 4 : 16 / n; }

inline __m512bh broadcast_pair(const std::uint16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// acc[r][j] += A row (row0 + r) . B column group (group0 + j) over g.k_chunks
// chunks, for the first M of the block's N groups.
template <int R, int N, int M = N>
inline void accumulate(__m512 (&acc)[R][N], const PairGemm& g, std::int64_t row0, std::int64_t group0) {
  const std::uint16_t* a = g.a + row0 * g.a_stride;
  const std::uint16_t* b = g.b + group0 * g.b_group;
  LineDrip* const drip = g.drip;
  for (std::int64_t kc = 0; kc < g.k_chunks; ++kc) {
    if (drip) drip->step();
    const std::uint16_t* ak = a + kc * g.a_chunk;
    const std::uint16_t* bk = b + kc * g.b_chunk;
    for (int p = 0; p < 16; ++p) {
      __m512bh bv[M];
#pragma GCC unroll 4
      for (int j = 0; j < M; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bk + j * g.b_group + p * g.b_stride);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh av = broadcast_pair(ak + r * g.a_stride + 2 * p);
#pragma GCC unroll 4
        for (int j = 0; j < M; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
      }
    }
  }
}

// One register block: rows [row0, row0 + R) x groups [group0, group0 + N) of
// g, plus, where second is given, its product over the first n2 of those groups.
template <int N>
inline void block(bool accumulate_c, const PairGemm& g, std::int64_t row0, std::int64_t group0,
                  const PairGemm* second, int n2) {
  constexpr int R = rows_for(N);
  __m512 acc[R][N];
  float* c = g.c + row0 * g.c_stride + group0 * g.c_group;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j)
      acc[r][j] = accumulate_c ? _mm512_loadu_ps(c + r * g.c_stride + j * g.c_group) : _mm512_setzero_ps();
  accumulate<R, N>(acc, g, row0, group0);
  if (second) {
    switch (n2) {  // n2 <= N
      case 4: if constexpr (N >= 4) accumulate<R, N, 4>(acc, *second, row0, group0); break;
      case 3: if constexpr (N >= 3) accumulate<R, N, 3>(acc, *second, row0, group0); break;
      case 2: if constexpr (N >= 2) accumulate<R, N, 2>(acc, *second, row0, group0); break;
      case 1: accumulate<R, N, 1>(acc, *second, row0, group0); break;
      default: break;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) _mm512_storeu_ps(c + r * g.c_stride + j * g.c_group, acc[r][j]);
}

}  // namespace detail

// C [m_rows][n_groups * 16] (+)= A . B (m_rows a multiple of 16). Where second
// is given (same C, same rows), its product A2 . B2 is added to the column
// groups below n2_groups while they are in registers: the attention dkv pass
// adds its value part P^T.dO to the key part dS^T.Q that way.
//
// B is read once per register block of rows, so a deep contraction (the
// attention's K . Q^T: 18 chunks x 4 groups = 72 KiB of B) would stream B from
// L2 for every 4 rows. Such products run in slabs of contraction chunks whose B
// fits in L1 (kSlabBytes), each slab over all rows, the C block going through
// memory between slabs: in fp32, in contraction order, so the same bits.
inline void gemm(bool accumulate, const PairGemm& g, std::int64_t m_rows, std::int64_t n_groups,
                 const PairGemm* second = nullptr, std::int64_t n2_groups = 0) {
  constexpr int kCols = 4;
  constexpr std::int64_t kSlabBytes = 16 * 1024;
  constexpr std::int64_t kChunkGroupBytes = 16 * 64;  // 16 pairs x one zmm of B
  // Every row block of column groups [group0, group0 + n), with `sec` (if any)
  // over its first n2 of them.
  auto rows_of = [&](const PairGemm& pg, bool acc, std::int64_t group0, int n, const PairGemm* sec, int n2) {
    const std::int64_t rows = detail::rows_for(n);
    for (std::int64_t row0 = 0; row0 < m_rows; row0 += rows) {
      switch (n) {
        case 4: detail::block<4>(acc, pg, row0, group0, sec, n2); break;
        case 3: detail::block<3>(acc, pg, row0, group0, sec, n2); break;
        case 2: detail::block<2>(acc, pg, row0, group0, sec, n2); break;
        default: detail::block<1>(acc, pg, row0, group0, sec, n2); break;
      }
    }
  };
  // One product over its chunks in slabs of at most `slab` chunks.
  auto slabbed = [&](const PairGemm& pg, bool acc, std::int64_t group0, int n, std::int64_t slab) {
    for (std::int64_t k0 = 0; k0 < pg.k_chunks; k0 += slab) {
      PairGemm part = pg;
      part.a += k0 * pg.a_chunk;
      part.b += k0 * pg.b_chunk;
      part.k_chunks = std::min(slab, pg.k_chunks - k0);
      rows_of(part, acc || k0 > 0, group0, n, nullptr, 0);
    }
  };
  auto second_of = [&](std::int64_t group0, int n) {
    return second ? static_cast<int>(std::clamp<std::int64_t>(n2_groups - group0, 0, n)) : 0;
  };
  if (g.drip) {  // one step per chunk of every register block, of both products
    std::int64_t steps = 0;
    for (std::int64_t group0 = 0; group0 < n_groups; group0 += kCols) {
      const int n = static_cast<int>(std::min<std::int64_t>(kCols, n_groups - group0));
      const std::int64_t blocks = (m_rows + detail::rows_for(n) - 1) / detail::rows_for(n);
      steps += blocks * (g.k_chunks + (second_of(group0, n) > 0 ? second->k_chunks : 0));
    }
    g.drip->pace(steps);
  }
  for (std::int64_t group0 = 0; group0 < n_groups; group0 += kCols) {
    const int n = static_cast<int>(std::min<std::int64_t>(kCols, n_groups - group0));
    const int n2 = second_of(group0, n);
    const PairGemm* sec = n2 > 0 ? second : nullptr;
    const std::int64_t slab = std::max<std::int64_t>(1, kSlabBytes / (n * kChunkGroupBytes));
    if (g.k_chunks > slab || (sec && sec->k_chunks > slab)) {
      slabbed(g, accumulate, group0, n, slab);
      if (sec) slabbed(*sec, true, group0, n2, std::max<std::int64_t>(1, kSlabBytes / (n2 * kChunkGroupBytes)));
      continue;
    }
    rows_of(g, accumulate, group0, n, sec, n2);
  }
}

}  // namespace
}  // namespace dsa::cpu::avx512bf16
