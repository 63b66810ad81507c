// AVX-512 candidate filter of the running top-k: 16 scores per step are turned
// into order keys, compared with the bar and compress-stored.
#include <immintrin.h>

#include "cpu/indexer/row_topk.h"

namespace dsa::cpu::indexer_kernels {

std::int64_t append_candidates_avx512(const float* scores, std::int64_t n,
                                      std::int32_t first_position, std::uint32_t bar,
                                      bool accept_all, std::uint32_t* keys,
                                      std::int32_t* positions) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i low31 = _mm512_set1_epi32(0x7fffffff);
  const __m512i bar_v = _mm512_set1_epi32(static_cast<int>(bar));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 zero = _mm512_setzero_ps();
  std::int64_t count = 0;
  for (std::int64_t s = 0; s < n; s += 16) {
    const __mmask16 in_range = n - s >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - s)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(in_range, scores + s);
    const __mmask16 is_number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    const __m512i bits = _mm512_castps_si512(_mm512_add_ps(v, zero));  // -0 -> +0
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    const __m512i ordered = _mm512_mask_xor_epi32(bits, negative, bits, low31);
    const __m512i key = _mm512_maskz_xor_epi32(is_number, ordered, sign);  // NaN -> 0
    __mmask16 take = accept_all ? in_range : _mm512_mask_cmpgt_epu32_mask(in_range, key, bar_v);
    if (!take) continue;
    const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(first_position + static_cast<std::int32_t>(s)));
    _mm512_mask_compressstoreu_epi32(keys + count, take, key);
    _mm512_mask_compressstoreu_epi32(positions + count, take, pos);
    count += __builtin_popcount(take);
  }
  return count;
}

}  // namespace dsa::cpu::indexer_kernels
