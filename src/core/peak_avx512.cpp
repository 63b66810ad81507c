// AVX-512 FMA and vdpbf16ps peak loops (compiled with the AVX-512 flags; the
// bf16 one also targets avx512bf16, which the avx512 kernels of dsa do not
// assume; each is called only where the CPU has its instructions).
#include <immintrin.h>

#include "core/peak_kernels.h"

namespace dsa::core {

float peak_loop_fma_avx512(std::int64_t iters) {
  // acc = acc * m + c with m just below 1: the values settle instead of
  // overflowing or going subnormal.
  __m512 m = _mm512_set1_ps(0.999999f);
  __m512 c = _mm512_set1_ps(1e-6f);
  __asm__("" : "+v"(m), "+v"(c));  // opaque: the optimiser must not fold any chain
  __m512 acc[kPeakChainsAvx512];
  for (int j = 0; j < kPeakChainsAvx512; ++j) acc[j] = _mm512_set1_ps(0.5f + 0.01f * j);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChainsAvx512; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kPeakChainsAvx512; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512bf16"))) float peak_loop_dpbf16_avx512(std::int64_t iters) {
  // acc += a[2i] * b[2i] + a[2i+1] * b[2i+1] per fp32 lane. Small normal
  // operands: the sums grow slowly and stay normal for any run length here.
  __m512 small = _mm512_set1_ps(1e-3f);
  __asm__("" : "+v"(small));  // opaque: the optimiser must not fold any chain
  const __m512bh a = _mm512_cvtne2ps_pbh(small, small);
  const __m512bh b = _mm512_cvtne2ps_pbh(small, small);
  __m512 acc[kPeakChainsAvx512];
  for (int j = 0; j < kPeakChainsAvx512; ++j) acc[j] = _mm512_set1_ps(0.01f * j);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChainsAvx512; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kPeakChainsAvx512; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return _mm512_reduce_add_ps(sum);
}

}  // namespace dsa::core
