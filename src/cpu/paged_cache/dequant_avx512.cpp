// Records to bf16, AVX-512: 16 e4m3 codes per step decoded arithmetically
// (sign, 4-bit exponent biased by 7, 3-bit mantissa; subnormals m * 2^-9;
// 0x7f / 0xff NaN), times the scale, rounded as core::float_to_bf16 rounds.
//
// The scales dsa_cache_write stores are powers of two (core::e4m3_group_scale),
// and a code times 2^k is then a bf16 value exactly: 32 codes per step go
// straight to bf16 bits in 16-bit lanes (the code's exponent and mantissa
// moved into place, k added to the exponent), about a quarter of the work of
// the fp32 route, which stays for any other scale. At H = 16 heads the fp32
// route took about as long per key as the attention's own products (Zen 4).
#include <immintrin.h>

#include <cmath>

#include "cpu/paged_cache/dequant.h"

namespace dsa::cpu::dequant {
namespace {

// 32 codes to bf16 bits, scale = 2^k (normal_power_of_two): a normal code
// (exponent field e > 0) is bf16 with exponent e - 7 + 127 + k and its 3
// mantissa bits on top of bf16's 7; the 8 subnormal magnitudes m * 2^-9 (and
// zero) from a table; 0x7f / 0xff the table's unsigned NaN, 0x7fc0.
void run_power_of_two(const std::uint8_t* codes, std::int64_t n, int k, std::uint16_t* out) {
  alignas(64) static const std::uint16_t subnormal[32] = {
      0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};  // m * 2^-9, m = 0..7
  const __m512i table = _mm512_load_si512(subnormal);
  const __m512i x7f = _mm512_set1_epi16(0x7f), bias = _mm512_set1_epi16(static_cast<short>(120 << 7));
  const __m512i shift = _mm512_set1_epi16(static_cast<short>(k * 128)), nan = _mm512_set1_epi16(0x7fc0);
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)));
    const __m512i mag = _mm512_and_si512(c, x7f);
    const __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));  // exponent field 0
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
    v = _mm512_mask_permutexvar_epi16(v, small, mag, table);
    const __mmask32 zero = _mm512_cmpeq_epi16_mask(mag, _mm512_setzero_si512());
    v = _mm512_mask_add_epi16(v, ~zero, v, shift);  // times 2^k; zero stays zero
    v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_srli_epi16(c, 7), 15));  // the sign
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, x7f), nan);
    _mm512_storeu_si512(out + i, v);
  }
  portable_kernel().any_scale(codes + i, n - i, std::ldexp(1.0f, k), out + i);  // the last < 32 codes
}

// Any scale: through fp32.
void run_any_scale(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) {
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
  portable_kernel().any_scale(codes + i, n - i, scale, out + i);  // the last < 16 codes
}

}  // namespace

const Fp8Dequant& avx512_kernel() {
  static const Fp8Dequant kernel{"avx512", run_any_scale, run_power_of_two};
  return kernel;
}

}  // namespace dsa::cpu::dequant
