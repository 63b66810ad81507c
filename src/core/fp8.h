// FP8 e4m3 (the "fn" variant of OCP FP8: no infinities, 0x7f / 0xff NaN,
// largest finite 448) and the power-of-two scales of the FP8 paged caches.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace dsa::core {
// Internal linkage, as numeric.h: compiled into ISA-specific files too.
namespace {

inline constexpr float kE4m3Max = 448.0f;

// fp32 -> e4m3, round to nearest even; finite values beyond 448 saturate to
// 448 (a cache scale keeps |x| <= 448, so this only guards), NaN -> NaN.
inline std::uint8_t float_to_e4m3(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  const float af = std::fabs(f);
  if (af >= kE4m3Max) return sign | 0x7e;
  if (af < 0x1p-6f) {
    // Subnormal range: multiples of 2^-9; af * 512 is exact, nearbyint rounds
    // half to even (the default rounding mode). 8 is the smallest normal, 0x08.
    return sign | static_cast<std::uint8_t>(std::nearbyint(af * 512.0f));
  }
  int exponent = static_cast<int>(a >> 23) - 127;  // -6 .. 8
  std::uint32_t mantissa = (a & 0x7fffffu) >> 20;
  const std::uint32_t rest = a & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (mantissa & 1u))) ++mantissa;
  if (mantissa == 8) mantissa = 0, ++exponent;
  const std::uint32_t code = (static_cast<std::uint32_t>(exponent + 7) << 3) | mantissa;
  return sign | static_cast<std::uint8_t>(code > 0x7eu ? 0x7eu : code);
}

inline float e4m3_to_float_slow(std::uint8_t code) {
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

// All 256 values, for table lookups in the kernels.
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_float_slow(static_cast<std::uint8_t>(c));
    return t;
  }();
  return table;
}

// The scale of a group whose largest magnitude is `amax`: the smallest power
// of two with amax / scale <= 448, so that x / scale and code * scale are
// exact. 1 for an all-zero group; NaN when the group holds a NaN or an
// infinity (the values then read back as NaN: a bad input is not hidden).
inline float e4m3_group_scale(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 1.0f;
  int e = 0;
  // In double, where amax / 448 is never rounded onto a power of two (the
  // nearest float amax above 448 * 2^k is 2^k * (1 + 2^-21 / 7)).
  const double f = std::frexp(static_cast<double>(amax) / 448.0, &e);  // = f * 2^e, f in [0.5, 1)
  // At least 2^-126, the smallest normal: a subnormal scale would lose the
  // exactness of x / scale.
  const int k = f == 0.5 ? e - 1 : e;
  return std::ldexp(1.0f, k < -126 ? -126 : k);
}

}  // namespace
}  // namespace dsa::core
