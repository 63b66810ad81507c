// Records to bf16 for the decode kernels: an FP8 record's codes times their
// power-of-two scales are bf16 values exactly (but for values under 2^-130, in a
// group whose scale stops at 2^-126: rounded once), so a decode kernel scores FP8
// keys with the bf16 kernels after this one pass per key (every head then
// reads the bf16 row). One kernel per ISA (cpu/select.h); all write the bits
// core::float_to_bf16 gives for e4m3_table()[code] * scale, NaN included.
//
// The same values in fp32 (record_to_f32) for the kernels that compute in fp32
// FMAs whatever the dtype (AVX2, AVX-512 without AVX512-BF16, portable): they
// would widen the bf16 row anyway, and a code goes to fp32 in fewer operations
// than to bf16 and back.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/paged_cache.h"

namespace dsa::cpu::dequant {

// k where scale = 2^k and every nonzero e4m3 value (2^-9 .. 448 = 1.75 * 2^8)
// times it is a normal bf16 number, so a code times the scale goes to bf16 bits
// by integer work alone (the vector kernels' fast route); otherwise false.
bool normal_power_of_two(float scale, int* k);

// One ISA's FP8 dequantiser: e4m3 codes times a scale, as bf16 (run) or fp32 (run_f32).
struct Fp8Dequant {
  const char* name;
  // Any scale (through fp32).
  void (*any_scale)(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out);
  // scale = 2^k with normal_power_of_two true (integer work only); null: any_scale serves.
  void (*power_of_two)(const std::uint8_t* codes, std::int64_t n, int k, std::uint16_t* out) = nullptr;
  // The same values as fp32, scale = 2^k with normal_power_of_two true (the
  // products are then exact in fp32); null: run's bf16 widened.
  void (*power_of_two_f32)(const std::uint8_t* codes, std::int64_t n, int k, float* out) = nullptr;

  // out[i] = bf16(e4m3(codes[i]) * scale) for i < n.
  // Out of line (dequant.cpp): an inline body would be compiled into the ISA files too.
  void run(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) const;
  // out[i] = the same value as fp32 (exact: every bf16 value is an fp32 value).
  void run_f32(const std::uint8_t* codes, std::int64_t n, float scale, float* out) const;
  // Whether run_f32 has a vector route for the scales dsa_cache_write stores (AVX2,
  // portable; not the avx512 level yet). The decode ops hand the fp32 FMA kernels
  // fp32 keys only where it has: without it, run_f32 is run's bf16 widened, and the
  // kernels' own widening of the bf16 row costs the same.
  bool has_f32_route() const { return power_of_two_f32 != nullptr; }
};

const Fp8Dequant& portable_kernel();
const Fp8Dequant& avx2_kernel();
const Fp8Dequant& avx512_kernel();
// The best this CPU runs.
const Fp8Dequant& pick_fp8_dequant();

// The dtype a decode kernel computes in: bf16 for bf16 queries when every cache
// stores bf16 or FP8 (FP8 values are bf16 values exactly), fp32 otherwise.
inline DType kernel_dtype(DType query, std::initializer_list<const core::PagedCache*> caches) {
  if (query != DType::bf16) return DType::f32;
  for (const core::PagedCache* c : caches)
    if (c && c->layout.dtype == CacheDType::f32) return DType::f32;
  return DType::bf16;
}

// Whether the kernel reads `cache`'s records in place as rows of `kernel`
// dtype: the storage is that dtype, and the tensor sits at an address its
// elements can (a misaligned one is dequantised instead: the kernels load bf16
// and fp32 elements as such).
inline bool records_are_rows(const core::PagedCache& cache, DType kernel) {
  const bool same = kernel == DType::bf16 ? cache.layout.dtype == CacheDType::bf16
                                          : cache.layout.dtype == CacheDType::f32;
  return same && reinterpret_cast<std::uintptr_t>(cache.data) % dtype_size(kernel) == 0;
}

// A bf16 or FP8 record of `cache` as `dim` bf16 values (fp32 records: rounded).
void record_to_bf16(const core::PagedCache& cache, const std::uint8_t* record, std::uint16_t* out,
                    const Fp8Dequant& kernel);
// record_to_bf16's values as `dim` fp32 values for bf16 and FP8 records (an fp32
// record: core::decode_token's, unrounded; no bf16 kernel reads one).
void record_to_f32(const core::PagedCache& cache, const std::uint8_t* record, float* out, const Fp8Dequant& kernel);

}  // namespace dsa::cpu::dequant
