// AVX-512-BF16 attention kernels (bf16 inputs) for CPUs without AMX (Zen 4,
// Zen 5, Cooper Lake) and for AMX CPUs under DSA_ISA=avx512_bf16: the
// pair-layout algorithm of kernels_pairs.inc with every product on vdpbf16ps.
//
// The products keep the AMX tile layouts, so the operands packed for the tile
// engine serve as they are: a B tile row is one zmm (16 columns x one pair of
// contraction indices), and an A element pair is one 32-bit broadcast. A
// register block of kRows C rows x up to kCols column groups of 16 stays in
// zmm accumulators over the whole contraction.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dsa::cpu::attention_kernels {
namespace {

constexpr int kRows = 4;  // C rows per register block (divides the 16 of a tile row)
constexpr int kCols = 4;  // column groups of 16 per register block: 16 accumulators

void configure_tiles() {}  // no tile state

inline __m512bh broadcast_pair(const std::uint16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// acc[r][j] += A rows r . B column group j over k_chunks chunks of 32.
template <int N>
inline void dot_accumulate(__m512 (&acc)[kRows][kCols], const std::uint16_t* a, std::int64_t a_stride,
                           const std::uint16_t* b, std::int64_t b_stride, std::int64_t b_chunk, std::int64_t b_group,
                           std::int64_t k_chunks) {
  for (std::int64_t kc = 0; kc < k_chunks; ++kc) {
    const std::uint16_t* ak = a + kc * 32;
    const std::uint16_t* bk = b + kc * b_chunk;
    for (int p = 0; p < 16; ++p) {
      __m512bh bv[N];
#pragma GCC unroll 4
      for (int j = 0; j < N; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bk + j * b_group + p * b_stride);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512bh av = broadcast_pair(ak + r * a_stride + 2 * p);
#pragma GCC unroll 4
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
      }
    }
  }
}

template <int N>
void dot_block(bool accumulate, float* c, std::int64_t c_stride, const std::uint16_t* a, std::int64_t a_stride,
               const std::uint16_t* b, std::int64_t b_stride, std::int64_t b_chunk, std::int64_t b_group,
               std::int64_t k_chunks, int n2, const std::uint16_t* a2, const std::uint16_t* b2,
               std::int64_t b2_stride, std::int64_t b2_chunk, std::int64_t k2_chunks) {
  __m512 acc[kRows][kCols];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * c_stride + j * 16) : _mm512_setzero_ps();
  dot_accumulate<N>(acc, a, a_stride, b, b_stride, b_chunk, b_group, k_chunks);
  // The second product covers the first n2 column groups of this block.
  switch (n2) {
    case 4: dot_accumulate<4>(acc, a2, a_stride, b2, b2_stride, b2_chunk, b_group, k2_chunks); break;
    case 3: dot_accumulate<3>(acc, a2, a_stride, b2, b2_stride, b2_chunk, b_group, k2_chunks); break;
    case 2: dot_accumulate<2>(acc, a2, a_stride, b2, b2_stride, b2_chunk, b_group, k2_chunks); break;
    case 1: dot_accumulate<1>(acc, a2, a_stride, b2, b2_stride, b2_chunk, b_group, k2_chunks); break;
    default: break;
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) _mm512_storeu_ps(c + r * c_stride + j * 16, acc[r][j]);
}

// The product contract of kernels_pairs.inc ("Products"), register-blocked.
void tile_gemm2(bool accumulate, float* c, std::int64_t c_stride, std::int64_t m_tiles, std::int64_t n_groups,
                const std::uint16_t* a, std::int64_t a_stride, const std::uint16_t* b, std::int64_t b_stride,
                std::int64_t b_chunk, std::int64_t b_group, std::int64_t k_chunks, std::int64_t n2_groups,
                const std::uint16_t* a2, const std::uint16_t* b2, std::int64_t b2_stride, std::int64_t b2_chunk,
                std::int64_t k2_chunks) {
  for (std::int64_t ng = 0; ng < n_groups; ng += kCols) {
    const int n = static_cast<int>(std::min<std::int64_t>(kCols, n_groups - ng));
    const int n2 = static_cast<int>(std::max<std::int64_t>(0, std::min<std::int64_t>(n, n2_groups - ng)));
    for (std::int64_t row = 0; row < m_tiles * 16; row += kRows) {
      float* cb = c + row * c_stride + ng * 16;
      const std::uint16_t* ab = a + row * a_stride;
      const std::uint16_t* a2b = a2 ? a2 + row * a_stride : nullptr;
      const std::uint16_t* bb = b + ng * b_group;
      const std::uint16_t* b2b = b2 ? b2 + ng * b_group : nullptr;
      switch (n) {
        case 4: dot_block<4>(accumulate, cb, c_stride, ab, a_stride, bb, b_stride, b_chunk, b_group, k_chunks, n2, a2b, b2b, b2_stride, b2_chunk, k2_chunks); break;
        case 3: dot_block<3>(accumulate, cb, c_stride, ab, a_stride, bb, b_stride, b_chunk, b_group, k_chunks, n2, a2b, b2b, b2_stride, b2_chunk, k2_chunks); break;
        case 2: dot_block<2>(accumulate, cb, c_stride, ab, a_stride, bb, b_stride, b_chunk, b_group, k_chunks, n2, a2b, b2b, b2_stride, b2_chunk, k2_chunks); break;
        default: dot_block<1>(accumulate, cb, c_stride, ab, a_stride, bb, b_stride, b_chunk, b_group, k_chunks, n2, a2b, b2b, b2_stride, b2_chunk, k2_chunks); break;
      }
    }
  }
}

}  // namespace
}  // namespace dsa::cpu::attention_kernels

#define DSA_PAIR_KERNEL_NAME avx512_bf16_kernel
#define DSA_PAIR_KERNEL_LABEL "avx512_bf16"
#include "cpu/sparse_attention/kernels_pairs.inc"
