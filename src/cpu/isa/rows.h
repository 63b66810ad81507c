// Rows of storage-dtype elements (fp32, bf16, fp16) to fp32 and back, the one
// home of these converters for every kernel. Compiled into files built for
// different ISAs, so everything has internal linkage; where the including file
// is built for AVX2 or AVX-512 the bf16 and fp16 loads use its vector widths.
// Results are exact (bf16/fp16 -> fp32) or rounded to nearest even
// (core::float_to_bf16 / float_to_f16), the same bits on every ISA.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "core/numeric.h"
#include "dsa/tensor.h"

namespace dsa::cpu::rows {
namespace {

// n elements at src to fp32 at dst, then zeros up to `padded` (>= n).
inline void to_float(const void* src, DType dtype, std::int64_t n, std::int64_t padded, float* dst) {
  std::int64_t i = 0;
  if (n > 0) switch (dtype) {  // (n == 0: src and dst may be an empty buffer's null pointer)
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); i = n; break;
    case DType::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      }
#endif
#if defined(__AVX2__)
      for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
#endif
      for (; i < n; ++i) dst[i] = core::bf16_to_float(s[i]);
      break;
    }
    default: {
      const auto* s = static_cast<const std::uint16_t*>(src);
#if defined(__AVX2__) && defined(__F16C__)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
      for (; i < n; ++i) dst[i] = core::f16_to_float(s[i]);
      break;
    }
  }
  for (; i < padded; ++i) dst[i] = 0.0f;
}

// n fp32 values to storage-dtype elements at dst.
inline void from_float(const float* src, DType dtype, std::int64_t n, void* dst) {
  if (n <= 0) return;
  switch (dtype) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); break;
    case DType::bf16: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (std::int64_t i = 0; i < n; ++i) d[i] = core::float_to_bf16(src[i]);
      break;
    }
    default: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (std::int64_t i = 0; i < n; ++i) d[i] = core::float_to_f16(src[i]);
      break;
    }
  }
}

}  // namespace
}  // namespace dsa::cpu::rows
