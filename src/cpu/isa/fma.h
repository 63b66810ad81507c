// fp32 FMA building blocks for the AVX2 and AVX-512 kernels: one vector type
// and its operations for the ISA the including file is compiled for (8-lane
// ymm under -mavx2, 16-lane zmm under -mavx512f), and a register-blocked GEMM
// on it. Include only from *_avx2.cpp / *_avx512.cpp files (or the kernel headers
// they include).
//
// Everything here has internal linkage: the same names are compiled for
// several ISAs in one library and must never be merged by the linker.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/numeric.h"
#include "cpu/isa/rows.h"
#if defined(__AVX512F__)
#include "cpu/isa/avx512.h"
#endif

namespace dsa::cpu::fma {
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// x where ref is finite-or-+inf (a head with a max), 0 where ref == -inf.
inline Vec vlive(Vec ref, Vec x) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ref, _mm512_set1_ps(core::kNegInf), _CMP_NEQ_OQ), x);
}
// y where x is not below lo (NaN x keeps y), else 0.
inline Vec vzero_below(Vec x, float lo, Vec y) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(lo), _CMP_NLT_UQ), y);
}
// Register block of the GEMM: kMr broadcast rows x kNr vectors of C.
constexpr int kMr = 6, kNr = 4;
#else
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// n is integral in [-126, 127] here (inputs clamped at -87, at most a few above 0).
inline Vec vpow2(Vec p, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline Vec vlive(Vec ref, Vec x) {
  return _mm256_and_ps(_mm256_cmp_ps(ref, _mm256_set1_ps(core::kNegInf), _CMP_NEQ_OQ), x);
}
// y where x is not below lo (NaN x keeps y), else 0.
inline Vec vzero_below(Vec x, float lo, Vec y) { return _mm256_and_ps(_mm256_cmp_ps(x, vset(lo), _CMP_NLT_UQ), y); }
// 16 ymm registers: 12 accumulators, 2 B vectors, 1 broadcast.
constexpr int kMr = 6, kNr = 2;
#endif

// exp of x in [-87, ~88]: the polynomial itself.
inline Vec vexp_clamped(Vec x) {
  const Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vfma(n, vset(-0.693145751953125f), x);
  r = vfma(n, vset(-1.428606765330187e-06f), r);
  Vec p = vset(1.0f / 720);
  p = vfma(p, r, vset(1.0f / 120));
  p = vfma(p, r, vset(1.0f / 24));
  p = vfma(p, r, vset(1.0f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vpow2(p, n);
}

// exp for the softmax: degree-6 polynomial on the reduced argument (fp32 accurate).
// The clamp takes x as the second operand of max, which is what max returns
// when either is NaN: a NaN logit gives a NaN weight, as in the reference.
// Below -87 the weight is exactly 0, not exp(-87): a key whose logit is -inf (an
// infinite key element against a query of the other sign) must weigh 0, so that
// its infinite value makes the output NaN (0 * inf), as in the reference, not inf.
inline Vec vexp(Vec logit) {
  return vzero_below(logit, -87.0f, vexp_clamped(vmax(vset(-87.0f), logit)));
}

// ---------------------------------------------------------------------------
// C rows (+)= A . B: crow[m][n] for n < N (a multiple of kLanes),
// A(m, k) = arow[m][k * a_step], B row k at b + k * b_stride.
template <int MR, int NR>
void gemm_block(const float* const* arow, std::int64_t a_step, const float* b, std::int64_t b_stride,
                std::int64_t K, float* const* crow, std::int64_t col, bool accumulate) {
  Vec acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[r][j] = accumulate ? vload(crow[r] + col + j * kLanes) : vzero();
  const float* a[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) a[r] = arow[r];
  for (std::int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * b_stride + col;
    Vec bv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) bv[j] = vload(bk + j * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec av = vset(a[r][k * a_step]);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[r][j] = vfma(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) vstore(crow[r] + col + j * kLanes, acc[r][j]);
}

using BlockFn = void (*)(const float* const*, std::int64_t, const float*, std::int64_t, std::int64_t, float* const*,
                         std::int64_t, bool);

template <int MR, int... NR>
constexpr auto row_of_blocks(std::integer_sequence<int, NR...>) {
  return std::array<BlockFn, sizeof...(NR)>{&gemm_block<MR, NR + 1>...};
}
template <int... MR>
constexpr auto table_of_blocks(std::integer_sequence<int, MR...>) {
  return std::array<std::array<BlockFn, kNr>, sizeof...(MR)>{row_of_blocks<MR + 1>(std::make_integer_sequence<int, kNr>{})...};
}
constexpr auto kBlocks = table_of_blocks(std::make_integer_sequence<int, kMr>{});

inline void gemm(std::int64_t M, std::int64_t N, std::int64_t K, const float* const* arow, std::int64_t a_step,
          const float* b, std::int64_t b_stride, float* const* crow, bool accumulate) {
  for (std::int64_t col = 0; col < N; col += kNr * kLanes) {
    const int nr = static_cast<int>(std::min<std::int64_t>(kNr, (N - col) / kLanes));
    for (std::int64_t m = 0; m < M; m += kMr) {
      const int mr = static_cast<int>(std::min<std::int64_t>(kMr, M - m));
      kBlocks[mr - 1][nr - 1](arow + m, a_step, b, b_stride, K, crow + m, col, accumulate);
    }
  }
}

// n storage-dtype elements to fp32, zeros up to `padded` (cpu/isa/rows.h).
using rows::to_float;


// dst[c][r] = src[r][c] for a rows x cols fp32 block (both multiples of
// kLanes), in kLanes x kLanes register transposes.
inline void transpose(const float* src, std::int64_t src_stride, std::int64_t rows, std::int64_t cols, float* dst,
                      std::int64_t dst_stride) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += kLanes)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      const float* s = src + r0 * src_stride + c0;
      float* d = dst + c0 * dst_stride + r0;
#if defined(__AVX512F__)
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(_mm512_loadu_ps(s + i * src_stride));
      avx512::transpose16x16(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(d + i * dst_stride, _mm512_castsi512_ps(v[i]));
#else
      __m256 v[8], t[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(s + i * src_stride);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        v[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        v[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        v[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        v[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
      }
      // v[4q + j] now holds rows 4q..4q+3 of column j (low half) and of column 4 + j (high half).
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(d + j * dst_stride, _mm256_permute2f128_ps(v[j], v[4 + j], 0x20));
        _mm256_storeu_ps(d + (4 + j) * dst_stride, _mm256_permute2f128_ps(v[j], v[4 + j], 0x31));
      }
#endif
    }
}

}  // namespace
}  // namespace dsa::cpu::fma
