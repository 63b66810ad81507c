// The AVX-512 vector layer of the pooling kernels (pool_simd.h): 16 channels
// per vector, k-masks for the masked heads and tails.
// Included by pool_avx512.cpp and, with AVX512-BF16 conversions, pool_avx512bf16.cpp.
// GCC 12 flags the self-initialised `_mm512_undefined_*` inside its own
// masked-intrinsic wrappers (a false positive of the header, not of this code).
#if defined(__GNUC__) && !defined(__clang__)  // clang has no -Wmaybe-uninitialized and warns of the pragma
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <array>
#include <cstdint>

#include "cpu/compressor/pool_kernels.h"
#include "cpu/isa/fma.h"

#ifndef DSA_POOL_KERNEL_FUNCTION
#define DSA_POOL_KERNEL_FUNCTION avx512_kernel
#define DSA_POOL_KERNEL_NAME "avx512"
#endif

namespace dsa::cpu::compressor_kernels {
namespace {

using namespace fma;
static_assert(kLanes == 16, "compiled with the AVX-512 flags");

#ifdef DSA_POOL_NATIVE_BF16
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif

// Backward strips of 64 channels (even or better than 32 there).
constexpr int kBackwardStrip = 64;
// Forward blocks of 4 rows (where rows_forward was measured, on Zen 5; the AVX2
// layer's 8 is unmeasured here).
constexpr int kRowBlock = 4;

// The group bodies forced inline: GCC otherwise leaves them out of line,
// reloading the exp constants and spilling around every group (one thread,
// on chip, CSA forward 3.4 ms without, 3.1 with; backward 6.7 vs 5.4).
#define DSA_POOL_GROUP_ATTRIBUTES __attribute__((always_inline))

// k-masks cost nothing on whole vectors: one lane type serves both.
using Lane = __mmask16;
using WholeLane = Lane;

inline Lane lane_mask(std::int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
inline Lane whole_lane() { return 0xffff; }

template <DType T>
inline __m512 load(const void* base, std::int64_t at, Lane mask) {
  if constexpr (T == DType::f32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + at);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const std::uint16_t*>(base) + at);
    if constexpr (T == DType::bf16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
}

inline __m512 loadf(const float* p, Lane mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline void storef(float* p, Lane mask, __m512 v) { _mm512_mask_storeu_ps(p, mask, v); }
inline __m512 load_scratch(const float* p) { return _mm512_load_ps(p); }
inline void store_scratch(float* p, __m512 v) { _mm512_store_ps(p, v); }

// 16 floats rounded to fp16 (nearest even; NaN stays NaN).
inline __m256i to_fp16(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Whether a group's bf16 stores must mend NaN lanes (store_group's `nan`):
// only the integer rounding below needs it, and NaN is rare, so one unordered
// compare of the group's two vectors finds any. vcvtne2ps2bf16 and vcvtps2ph
// keep NaN by themselves.
template <DType T>
inline bool has_nan(const __m512 (&v)[2]) {
  if constexpr (T == DType::bf16 && !kNativeBf16)
    return _mm512_cmp_ps_mask(v[0], v[1], _CMP_UNORD_Q) != 0;
  else
    return false;
}

// Without AVX512-BF16: 32 floats (two vectors) rounded to bf16 in channel
// order, nearest even. Each lane gets u + 0x7fff + (bit 16 of u), whose high
// 16 bits are the rounded value, and one two-source word permute picks those
// halves of both vectors (in place of a shift, a narrowing move and an insert
// per vector). That sum is wrong for NaN (it can carry into the exponent or
// the sign), so with `nan` (has_nan) the lanes of a NaN get u with the quiet
// bit set instead.
inline __m512i pack_bf16(__m512 lo, __m512 hi, bool nan) {
  const auto round = [](__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  };
  __m512i a = round(lo), b = round(hi);
  if (nan) [[unlikely]] {
    const __m512i quiet = _mm512_set1_epi32(0x00400000);
    a = _mm512_mask_or_epi32(a, _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q), _mm512_castps_si512(lo), quiet);
    b = _mm512_mask_or_epi32(b, _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q), _mm512_castps_si512(hi), quiet);
  }
  // Word 2i + 1 of a (i < 16), then of b: the high halves, channels 0-31.
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,  //
                                             31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, odd_words, b);
}

// One 64-byte store; with `stream`, a non-temporal one when the line is whole
// and aligned: large gradients are not read back by this call, and streaming
// skips the read-for-ownership a cached store of a line not yet on chip costs.
inline void store_line(void* p, __m512i v, __mmask64 bytes, bool stream) {
  if (stream && bytes == ~__mmask64{0} && (reinterpret_cast<std::uintptr_t>(p) & 63) == 0)
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  else
    _mm512_mask_storeu_epi8(p, bytes, v);
}

inline __mmask64 byte_mask(__mmask16 lanes, int lane_bytes) {
  __mmask64 bytes = 0;
  for (int i = 0; i < 16; ++i)
    if (lanes >> i & 1) bytes |= ((__mmask64{1} << lane_bytes) - 1) << (i * lane_bytes);
  return bytes;
}

// A group's two vectors (32 channels) at base[at]: one 64-byte line of bf16 /
// fp16 or two of fp32. `nan`: has_nan<T> of v, or of another group that is NaN wherever v is.
template <DType T>
inline void store_group(void* base, std::int64_t at, const __m512 (&v)[2], const std::array<Lane, 2>& mask,
                        bool stream, bool nan) {
  if constexpr (T == DType::f32) {
    float* p = static_cast<float*>(base) + at;
    if (mask[1] == 0xffff) {
      store_line(p, _mm512_castps_si512(v[0]), ~__mmask64{0}, stream);
      store_line(p + 16, _mm512_castps_si512(v[1]), ~__mmask64{0}, stream);
    } else {
      _mm512_mask_storeu_ps(p, mask[0], v[0]);
      _mm512_mask_storeu_ps(p + 16, mask[1], v[1]);
    }
  } else {
    __m512i packed;
    if constexpr (T == DType::bf16 && kNativeBf16)
      packed = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
    else if constexpr (T == DType::bf16)
      packed = pack_bf16(v[0], v[1], nan);
    else
      packed = _mm512_inserti64x4(_mm512_castsi256_si512(to_fp16(v[0])), to_fp16(v[1]), 1);
    const __mmask64 bytes = mask[1] == 0xffff ? ~__mmask64{0} : byte_mask(mask[0], 2) | byte_mask(mask[1], 2) << 32;
    store_line(static_cast<std::uint16_t*>(base) + at, packed, bytes, stream);
  }
}

// exp's argument split (exp2_nonpositive): f = t - floor(t) in one
// vreduceps, and 2^floor(t) applied by vscalefps, which also gives the
// subnormal results down to t = -149 and 0 below. No clamp is needed:
// vreduceps(-inf) is 0 and vscalefps(p, -inf) is 0; NaN stays NaN through both.
constexpr bool kCenteredExpSplit = false;  // f in [0, 1)
struct Pow2 {
  __m512 t, f;
};
inline Pow2 split_exp2(__m512 t) {
  return {t, _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};  // t - floor(t)
}
inline __m512 scale_exp2(__m512 p, const Pow2& s) { return _mm512_scalef_ps(p, s.t); }  // p * 2^floor(t)

// A channel whose logits are all -inf pools nothing: weights 0, not NaN.
inline __m512 safe_max(__m512 max) {
  const __mmask16 empty = _mm512_cmp_ps_mask(max, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(max, empty, _mm512_setzero_ps());
}

// 1 / sum where sum > 0, else 0: a 14-bit estimate and one Newton step
// (error within ~2 ulp; a divide costs ~16 cycles of one port per vector).
inline __m512 safe_reciprocal(__m512 sum) {
  const __mmask16 positive = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 r = _mm512_maskz_rcp14_ps(positive, sum);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(sum, r, _mm512_set1_ps(1.0f)), r);  // r (2 - sum r)
}

}  // namespace
}  // namespace dsa::cpu::compressor_kernels

#include "cpu/compressor/pool_simd.h"
