// Scalar conversions between the storage dtypes and fp32 (round to nearest even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "dsa/tensor.h"

namespace dsa::core {
// Internal linkage: these are compiled into ISA-specific files too, and the
// linker must never swap an AVX-512 copy into portable code.
namespace {

inline float bf16_to_float(std::uint16_t bits) {
  std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// IEEE half. clang before 15 has no _Float16 on x86 without AVX512-FP16; its
// storage-only __fp16 converts the same way (in hardware with -mf16c, which
// the clang 14 fuzz build of tests/fuzz passes).
#if defined(__clang__) && __clang_major__ < 15
using Half = __fp16;
#else
using Half = _Float16;
#endif

inline float f16_to_float(std::uint16_t bits) {
  Half h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline std::uint16_t float_to_f16(float f) {
  Half h = static_cast<Half>(f);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// Reads element `i` of a floating-point buffer of the given dtype as fp32.
inline float load_float(const void* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return std::numeric_limits<float>::quiet_NaN();
  }
}

// Writes fp32 `v` into element `i` of a floating-point buffer of the given dtype.
inline void store_float(void* base, DType dtype, std::int64_t i, float v) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[i] = v; break;
    case DType::bf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::f16: static_cast<std::uint16_t*>(base)[i] = float_to_f16(v); break;
    default: break;
  }
}

// Converts `n` contiguous elements to fp32.
inline void load_row(const void* base, DType dtype, std::int64_t n, float* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = load_float(base, dtype, i);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// The indexer score's ReLU, max(0, x), keeping NaN as torch.relu does
// (std::max(0, NaN) is 0, which would hide a NaN input); -inf gives 0.
template <class T>
inline T relu(T x) {
  return x != x ? x : (x > T(0) ? x : T(0));
}

}  // namespace
}  // namespace dsa::core
