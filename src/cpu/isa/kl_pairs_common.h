// AVX-512 helpers shared by the KL kernels on bf16 pairs (kl_loss/kl_sparse_pairs.h,
// dense_indexer/dense_kl_pairs.h). Include only from *_amx.cpp and *_avx512bf16.cpp files
// (they get the AVX-512 compile flags).
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "core/memory.h"
#include "cpu/isa/avx512.h"

namespace dsa::cpu::kl_kernels::pairs {

using ::dsa::cpu::avx512::transpose16x16;

// exp for lanes (Cephes-style, ~1 ulp), NaN propagates, exact 0 below -87.
inline __m512 exp512(__m512 x) {
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// Natural log for normal positive lanes (Cephes-style).
inline __m512 log512(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(126)));
  bits = _mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x3f000000));
  __m512 m = _mm512_castsi512_ps(bits);
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.0f));
  m = _mm512_mask_add_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.0f)), small, m, _mm512_sub_ps(m, _mm512_set1_ps(1.0f)));
  const __m512 z = _mm512_mul_ps(m, m);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.1514610310e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.1676998740e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.2420140846e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.4249322787e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.6668057665e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(2.0000714765e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-2.4999993993e-1f));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(3.3333331174e-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
  y = _mm512_fmadd_ps(_mm512_set1_ps(-2.12194440e-4f), e, y);
  y = _mm512_fmadd_ps(_mm512_set1_ps(-0.5f), z, y);
  return _mm512_fmadd_ps(_mm512_set1_ps(0.693359375f), e, _mm512_add_ps(m, y));
}

template <class T>
inline T* align64(core::ScratchVector<std::uint8_t>& v) {
  return reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t(63));
}


}  // namespace dsa::cpu::kl_kernels::pairs
