// Records to bf16, AVX-512F: 16 e4m3 codes per step decoded arithmetically
// (sign, 4-bit exponent biased by 7, 3-bit mantissa; subnormals m * 2^-9;
// 0x7f / 0xff NaN), times the scale, rounded as core::float_to_bf16 rounds.
#include <immintrin.h>

#include "core/numeric.h"
#include "cpu/paged_cache/dequant.h"

namespace dsa::cpu::dequant {
namespace {

void run_avx512(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i x7f = _mm512_set1_epi32(0x7f), seven = _mm512_set1_epi32(7);
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __m512i mag = _mm512_and_si512(c, x7f);
    const __m512i sign = _mm512_slli_epi32(_mm512_andnot_si512(x7f, c), 24);
    const __m512i e = _mm512_srli_epi32(mag, 3), m = _mm512_and_si512(mag, seven);
    // Normal: exponent e - 7 + 127, mantissa m in its top 3 bits.
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                           _mm512_slli_epi32(m, 20));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
    __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), normal,
                                           _mm512_castps_si512(sub));
    bits = _mm512_or_si512(bits, sign);
    // 0x7f and 0xff: the table's NaN, unsigned.
    bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, x7f), bits, _mm512_set1_epi32(0x7fc00000));
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), vscale);
    // core::float_to_bf16: round to nearest even; NaN: the top half, quiet.
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
  }
  const std::array<float, 256>& table = core::e4m3_table();
  for (; i < n; ++i) out[i] = core::float_to_bf16(table[codes[i]] * scale);
}

}  // namespace

const Fp8ToBf16& avx512_kernel() {
  static const Fp8ToBf16 kernel{"avx512", run_avx512};
  return kernel;
}

}  // namespace dsa::cpu::dequant
