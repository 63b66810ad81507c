// AVX2 + FMA pooling kernels: the kernels of pool_simd.h over an 8-lane ymm
// layer, for CPUs without AVX-512 (Zen 2/3, Haswell to Comet Lake). The
// layer's differences from the AVX-512 one:
// - no k-masks: whole vectors (WholeLane: every group but a row's last) take
//   plain loads and stores and compile without any tail code; a row's tail
//   (Lane: a count of valid lanes) takes vmaskmovps for fp32 and a small
//   zeroed block for 16-bit data (AVX2 has no 16-bit masked load or store);
// - a 32-channel group is four vectors; its bf16 / fp16 line is two 32-byte
//   stores, streamed back to back so the write-combining buffer sends the
//   whole line;
// - exp: the same polynomials on the same reduced argument, with floor (one
//   vroundps) and a subtraction for vreduceps and an exponent built in
//   integer lanes for vscalefps (so results below 2^-126 are 0, not
//   subnormal: weights that small are far below the rounding of any sum,
//   which holds a weight of 1);
// - 1 / sum from the 12-bit vrcpps estimate and two Newton steps;
// - 32-channel strips in both passes of the many-slot kernel: 16 registers
//   hold one group's 12 accumulators, not two groups'.
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>

#include "cpu/compressor/pool_kernels.h"
#include "cpu/isa/fma.h"

#define DSA_POOL_KERNEL_FUNCTION avx2_kernel
#define DSA_POOL_KERNEL_NAME "avx2"

namespace dsa::cpu::compressor_kernels {
namespace {

using namespace fma;
static_assert(kLanes == 8, "compiled with the AVX2 flags, without AVX-512");

constexpr int kBackwardStrip = 32;  // 16 ymm registers hold one group's 12 accumulators
// Forward blocks of 8 rows: half the scratch loads and stores per slot of 4-row
// blocks (Zen 1 class, HCA S = 16384 forward, 2 threads, min of 12 calls, 9 A/B
// rounds by process: 6.78-6.92 -> 6.53-6.68 ms; 16 rows 7.17-7.18 ms, too many
// row streams at once).
constexpr int kRowBlock = 8;

// GCC's own inlining choice: forcing the group bodies inline (as on
// AVX-512) made the CSA forward and backward ~2% slower here (one thread, on
// chip, three A/B runs), with 16 registers.
#define DSA_POOL_GROUP_ATTRIBUTES

struct Lane {
  int n;  // lanes [0, n) hold channels, 0 <= n <= 8
};
struct WholeLane {};

inline Lane lane_mask(std::int64_t n) { return {n <= 0 ? 0 : n >= 8 ? 8 : static_cast<int>(n)}; }
inline WholeLane whole_lane() { return {}; }

// vmaskmovps mask of lanes [0, n).
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <DType T>
inline __m256 load_whole(const void* base, std::int64_t at) {
  if constexpr (T == DType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + at);
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(base) + at);
    if constexpr (T == DType::bf16) {
      // bf16 -> fp32 is a move of each value into the high half of a 32-bit
      // lane: the 8 values broadcast to both 128-bit halves (a plain load on
      // current cores) and one in-lane byte shuffle, instead of a widening
      // shuffle and a shift. Control bytes with the top bit set give 0.
      const __m256i spread = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                              -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
      return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(p)), spread));
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(p));
    }
  }
}

template <DType T>
inline __m256 load(const void* base, std::int64_t at, WholeLane) {
  return load_whole<T>(base, at);
}

template <DType T>
inline __m256 load(const void* base, std::int64_t at, Lane mask) {
  if (mask.n == 8) [[likely]]
    return load_whole<T>(base, at);
  if constexpr (T == DType::f32) {
    return _mm256_maskload_ps(static_cast<const float*>(base) + at, first_lanes(mask.n));
  } else {
    std::uint16_t part[8] = {};
    if (mask.n > 0) std::memcpy(part, static_cast<const std::uint16_t*>(base) + at, mask.n * sizeof(std::uint16_t));
    return load_whole<T>(part, 0);
  }
}

inline __m256 loadf(const float* p, WholeLane) { return _mm256_loadu_ps(p); }
inline __m256 loadf(const float* p, Lane mask) {
  if (mask.n == 8) [[likely]]
    return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, first_lanes(mask.n));
}

inline void storef(float* p, WholeLane, __m256 v) { _mm256_storeu_ps(p, v); }
inline void storef(float* p, Lane mask, __m256 v) {
  if (mask.n == 8) [[likely]]
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, first_lanes(mask.n), v);
}

inline __m256 load_scratch(const float* p) { return _mm256_load_ps(p); }
inline void store_scratch(float* p, __m256 v) { _mm256_store_ps(p, v); }

// 8 floats rounded to bf16 (nearest even) in the low 16 bits of each 32-bit
// lane: the integer sequence of the AVX-512 layer. Not for NaN lanes, whose
// sum can carry into the exponent or the sign: with_quiet_nan mends those.
inline __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}

// `rounded` (round_bf16(v)) with v's NaN lanes as their quieted bf16 NaN.
inline __m256i with_quiet_nan(__m256 v, __m256i rounded) {
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// Whether a group's bf16 stores must mend NaN lanes (store_group's `nan`).
// NaN is rare: one unordered compare per two vectors finds any (a lane
// compares unordered when either value is NaN), and only then are the NaN
// lanes mended, instead of a compare and a blend per vector always (backward
// from statistics 2% faster here, 5% at AVX-512: one thread, on chip). fp16's
// vcvtps2ph and fp32 stores keep NaN by themselves.
template <DType T>
inline bool has_nan(const __m256 (&v)[4]) {
  if constexpr (T == DType::bf16) {
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q), _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
    return !_mm256_testz_ps(nan, nan);
  } else {
    return false;
  }
}

// 16 channels (two vectors) as 16 bf16 / fp16 values in channel order; `nan`:
// has_nan of their group.
template <DType T>
inline __m256i to_half(__m256 lo, __m256 hi, bool nan) {
  if constexpr (T == DType::bf16) {
    __m256i a = round_bf16(lo), b = round_bf16(hi);
    if (nan) [[unlikely]] {
      a = with_quiet_nan(lo, a);
      b = with_quiet_nan(hi, b);
    }
    // packus works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder the quarters.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
  } else {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm256_set_m128i(_mm256_cvtps_ph(hi, kRound), _mm256_cvtps_ph(lo, kRound));
  }
}

// 32 bytes at p; `stream` writes them non-temporally.
inline void store32(void* p, __m256i v, bool stream) {
  if (stream)
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}

// A whole group's four vectors (32 channels) at base[at]: one 64-byte line of
// bf16 / fp16 or two of fp32. Streamed (with `stream`) when its first line is
// 64-byte aligned, so every line is written whole and in order; otherwise
// ordinary stores. `nan`: has_nan<T> of v, or of another group that is NaN wherever v is.
template <DType T>
inline void store_group(void* base, std::int64_t at, const __m256 (&v)[4], const std::array<WholeLane, 4>&,
                        bool stream, bool nan) {
  if constexpr (T == DType::f32) {
    float* p = static_cast<float*>(base) + at;
    const bool nt = stream && (reinterpret_cast<std::uintptr_t>(p) & 63) == 0;
    for (int h = 0; h < 4; ++h) store32(p + 8 * h, _mm256_castps_si256(v[h]), nt);
  } else {
    std::uint16_t* p = static_cast<std::uint16_t*>(base) + at;
    const bool nt = stream && (reinterpret_cast<std::uintptr_t>(p) & 63) == 0;
    store32(p, to_half<T>(v[0], v[1], nan), nt);
    store32(p + 16, to_half<T>(v[2], v[3], nan), nt);
  }
}

// A row's last, partial group: only its lanes, with ordinary stores.
template <DType T>
inline void store_group(void* base, std::int64_t at, const __m256 (&v)[4], const std::array<Lane, 4>& mask, bool,
                        bool nan) {
  if constexpr (T == DType::f32) {
    for (int h = 0; h < 4; ++h) storef(static_cast<float*>(base) + at + 8 * h, mask[h], v[h]);
  } else {
    alignas(32) std::uint16_t line[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(line), to_half<T>(v[0], v[1], nan));
    _mm256_store_si256(reinterpret_cast<__m256i*>(line + 16), to_half<T>(v[2], v[3], nan));
    const int n = mask[0].n + mask[1].n + mask[2].n + mask[3].n;
    std::memcpy(static_cast<std::uint16_t*>(base) + at, line, n * sizeof(std::uint16_t));
  }
}

// exp's argument split (exp2_nonpositive): t clamped at -127, n = round(t)
// by adding 1.5 * 2^23 + 127 (the sum's low mantissa bits then hold n + 127)
// and f = t - n in [-1/2, 1/2] (exact), for the polynomials fitted on that
// range; scale_exp2 shifts those bits into the exponent field of 2^n. For
// n = -127 the field is 0, so every t below -126.5 (-inf included) gives
// exactly 0. One operation fewer than floor, a subtraction, a float to int
// conversion and the bias, and neither vroundps nor vcvtps2dq (CSA forward
// 5.9 -> 5.3 ms, one thread on chip).
constexpr bool kCenteredExpSplit = true;
struct Pow2 {
  __m256 biased, f;  // biased: t + 1.5 * 2^23 + 127, rounded to an integer
};
inline Pow2 split_exp2(__m256 t) {
  // max's second operand wins on NaN: keeps NaN (p is then NaN too).
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
  const __m256 magic = _mm256_set1_ps(12583039.0f);  // 1.5 * 2^23 + 127
  const __m256 biased = _mm256_add_ps(t, magic);
  return {biased, _mm256_sub_ps(t, _mm256_sub_ps(biased, magic))};
}
inline __m256 scale_exp2(__m256 p, const Pow2& s) {
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(s.biased), 23)));
}

// A channel whose logits are all -inf pools nothing: weights 0, not NaN.
inline __m256 safe_max(__m256 max) {
  return _mm256_andnot_ps(_mm256_cmp_ps(max, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ), max);
}

// 1 / sum where sum > 0, else 0 (a sum that is positive is at least 1: it
// holds the maximum's weight). vrcpps gives 12 bits; each Newton step
// r (2 - sum r) squares the relative error, so two reach fp32 rounding. Once
// per channel and entry, next to a slot loop of tens of operations.
inline __m256 safe_reciprocal(__m256 sum) {
  const __m256 positive = _mm256_cmp_ps(sum, _mm256_setzero_ps(), _CMP_GT_OQ);
  __m256 r = _mm256_and_ps(_mm256_rcp_ps(sum), positive);
  const __m256 one = _mm256_set1_ps(1.0f);
  r = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(sum, r, one), r);
  return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(sum, r, one), r);
}

}  // namespace
}  // namespace dsa::cpu::compressor_kernels

#include "cpu/compressor/pool_simd.h"
