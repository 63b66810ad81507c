// Records to bf16, AVX2: the AVX-512 kernel's two routes (dequant_avx512.cpp)
// in 256-bit registers, for the CPUs with AVX2 and FMA only, where the table
// walk of the portable kernel cost an FP8 key more than its products (about
// 3 ns a code against ~0.4 us of fp32 FMAs per key and 16 heads).
//
// Power-of-two scales (what dsa_cache_write stores): 16 codes per step in
// 16-bit lanes, integer work only. AVX2 has no 16-bit permute, so the 8
// subnormal magnitudes come from one byte shuffle: the low byte of each lane
// looks up the value's low byte, the high byte (index + 8) its high byte.
// Any other scale: 8 codes per step through fp32, rounded as
// core::float_to_bf16 rounds (nearest even; NaN kept, quiet).
//
// Power-of-two scales to fp32 (the fp32 FMA kernels' keys): through fp16. An
// e4m3 code's exponent and mantissa bits shifted up by 7 are an fp16 number
// 2^-8 times the code's value, subnormals included (fp16 has 1 more exponent
// bit and the same-sized subnormal step relative to it), so F16C's exact
// vcvtph2ps and one multiply by 2^(k+8) give code * 2^k: 16 codes in about 10
// operations, against about 18 to bf16 and a widening after it.
#include <immintrin.h>

#include <cmath>

#include "cpu/paged_cache/dequant.h"

namespace dsa::cpu::dequant {
namespace {

void run_power_of_two(const std::uint8_t* codes, std::int64_t n, int k, std::uint16_t* out) {
  // m * 2^-9 as bf16, m = 0..7: low bytes, then high bytes (both 128-bit halves).
  const __m256i subnormal = _mm256_setr_epi8(0x00, 0x00, char(0x80), char(0xc0), 0x00, 0x20, 0x40, 0x60,  //
                                             0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c,              //
                                             0x00, 0x00, char(0x80), char(0xc0), 0x00, 0x20, 0x40, 0x60,  //
                                             0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c);
  const __m256i x7f = _mm256_set1_epi16(0x7f), eight = _mm256_set1_epi16(8), hi_half = _mm256_set1_epi16(0x0800);
  const __m256i bias = _mm256_set1_epi16(static_cast<short>(120 << 7));
  const __m256i shift = _mm256_set1_epi16(static_cast<short>(k * 128)), nan = _mm256_set1_epi16(0x7fc0);
  const __m256i sign_bit = _mm256_set1_epi16(0x80), zero = _mm256_setzero_si256();
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256i mag = _mm256_and_si256(c, x7f);
    // Normal (exponent field e > 0): exponent e - 7 + 127, the 3 mantissa bits on top of bf16's 7.
    __m256i v = _mm256_add_epi16(_mm256_slli_epi16(mag, 4), bias);
    const __m256i index = _mm256_add_epi16(_mm256_or_si256(mag, _mm256_slli_epi16(mag, 8)), hi_half);
    v = _mm256_blendv_epi8(v, _mm256_shuffle_epi8(subnormal, index), _mm256_cmpgt_epi16(eight, mag));
    v = _mm256_add_epi16(v, _mm256_andnot_si256(_mm256_cmpeq_epi16(mag, zero), shift));  // zero stays zero
    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(c, sign_bit), 8));
    v = _mm256_blendv_epi8(v, nan, _mm256_cmpeq_epi16(mag, x7f));  // 0x7f / 0xff: unsigned NaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), v);
  }
  portable_kernel().any_scale(codes + i, n - i, std::ldexp(1.0f, k), out + i);  // the last < 16 codes
}

void run_any_scale(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i x7f = _mm256_set1_epi32(0x7f), seven = _mm256_set1_epi32(7), zero = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256i mag = _mm256_and_si256(c, x7f);
    const __m256i sign = _mm256_slli_epi32(_mm256_andnot_si256(x7f, c), 24);
    const __m256i e = _mm256_srli_epi32(mag, 3), m = _mm256_and_si256(mag, seven);
    const __m256i normal = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
                                           _mm256_slli_epi32(m, 20));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
    __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), _mm256_cmpeq_epi32(e, zero));
    bits = _mm256_or_si256(bits, sign);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(mag, x7f));
    const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(bits), vscale));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i half = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, half), 16);
    // |u| > inf as signed 32-bit compares: both sides are non-negative.
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);  // every lane <= 0xffff
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  portable_kernel().any_scale(codes + i, n - i, scale, out + i);  // the last < 8 codes
}

void run_power_of_two_f32(const std::uint8_t* codes, std::int64_t n, int k, float* out) {
  // normal_power_of_two bounds k to [-117, 119]: 2^(k+8) is a normal fp32 number.
  const __m256 scale = _mm256_set1_ps(std::ldexp(1.0f, k + 8));
  const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xbf80)), mag = _mm256_set1_epi16(0x3f80);
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // Sign-extended, then << 7: the sign lands in bit 15 (and a copy in bit 14,
    // cleared), exponent and mantissa in bits 7-13.
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), keep);
    // 0x7f / 0xff (magnitude bits all set) is NaN in e4m3; all ones is an fp16 NaN.
    h = _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, mag), mag));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale));
    _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale));
  }
  portable_kernel().power_of_two_f32(codes + i, n - i, k, out + i);  // the last < 16 codes
}

}  // namespace

const Fp8Dequant& avx2_kernel() {
  static const Fp8Dequant kernel{"avx2", run_any_scale, run_power_of_two, run_power_of_two_f32};
  return kernel;
}

}  // namespace dsa::cpu::dequant
