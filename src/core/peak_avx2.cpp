// AVX2 FMA peak loop (compiled with the AVX2 flags; called only where the CPU has them).
#include <immintrin.h>

#include "core/peak_kernels.h"

namespace dsa::core {

float peak_loop_fma_avx2(std::int64_t iters) {
  // acc = acc * m + c with m just below 1: the values settle instead of
  // overflowing or going subnormal (either would slow some CPUs down).
  __m256 m = _mm256_set1_ps(0.999999f);
  __m256 c = _mm256_set1_ps(1e-6f);
  __asm__("" : "+x"(m), "+x"(c));  // opaque: the optimiser must not fold any chain
  __m256 acc[kPeakChainsAvx2];
  for (int j = 0; j < kPeakChainsAvx2; ++j) acc[j] = _mm256_set1_ps(0.5f + 0.01f * j);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kPeakChainsAvx2; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < kPeakChainsAvx2; ++j) sum = _mm256_add_ps(sum, acc[j]);
  alignas(32) float out[8];
  _mm256_store_ps(out, sum);
  return out[0] + out[7];
}

}  // namespace dsa::core
