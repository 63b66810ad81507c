// Records to bf16: the portable kernel, the selection and the record walk (dequant.h).
#include "cpu/paged_cache/dequant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "cpu/select.h"

namespace dsa::cpu::dequant {
namespace {

void run_portable(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) {
  const std::array<float, 256>& table = core::e4m3_table();
  for (std::int64_t i = 0; i < n; ++i) out[i] = core::float_to_bf16(table[codes[i]] * scale);
}

// Exact: table * 2^k is a normal bf16 (normal_power_of_two), so an fp32 value too.
void run_portable_f32(const std::uint8_t* codes, std::int64_t n, int k, float* out) {
  const std::array<float, 256>& table = core::e4m3_table();
  const float scale = std::ldexp(1.0f, k);
  for (std::int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale;
}

constexpr Candidate<Fp8Dequant, int> kKernels[] = {
    {core::Isa::avx512, avx512_kernel},
    {core::Isa::avx2, avx2_kernel},
    {core::Isa::portable, portable_kernel},
};

}  // namespace

bool normal_power_of_two(float scale, int* k) {
  std::uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  const int biased = static_cast<int>(bits >> 23);  // the sign bit set makes this > 255
  if ((bits & 0x7fffff) != 0 || biased < 1 || biased > 254) return false;
  *k = biased - 127;
  return *k >= 1 - 118 && *k <= 254 - 135;  // exponents 2^-9 .. 2^8 stay inside bf16's normal range
}

void Fp8Dequant::run(const std::uint8_t* codes, std::int64_t n, float scale, std::uint16_t* out) const {
  int k = 0;
  if (power_of_two && normal_power_of_two(scale, &k)) power_of_two(codes, n, k, out);
  else any_scale(codes, n, scale, out);
}

void Fp8Dequant::run_f32(const std::uint8_t* codes, std::int64_t n, float scale, float* out) const {
  int k = 0;
  if (power_of_two_f32 && normal_power_of_two(scale, &k)) return power_of_two_f32(codes, n, k, out);
  std::uint16_t bf16[kCacheScaleGroup];
  for (std::int64_t i0 = 0; i0 < n; i0 += kCacheScaleGroup) {
    const std::int64_t m = std::min<std::int64_t>(kCacheScaleGroup, n - i0);
    run(codes + i0, m, scale, bf16);
    for (std::int64_t i = 0; i < m; ++i) out[i0 + i] = core::bf16_to_float(bf16[i]);
  }
}

const Fp8Dequant& portable_kernel() {
  static const Fp8Dequant kernel{"portable", run_portable, nullptr, run_portable_f32};
  return kernel;
}

const Fp8Dequant& pick_fp8_dequant() { return select_kernel(kKernels, 0); }

void record_to_bf16(const core::PagedCache& cache, const std::uint8_t* record, std::uint16_t* out,
                    const Fp8Dequant& kernel) {
  const CacheLayout& l = cache.layout;
  if (l.dtype == CacheDType::bf16) {
    std::memcpy(out, record, 2 * l.dim);
    return;
  }
  if (l.dtype == CacheDType::f32) {
    for (std::int64_t i = 0; i < l.dim; ++i) {
      float v;
      std::memcpy(&v, record + 4 * i, 4);
      out[i] = core::float_to_bf16(v);
    }
    return;
  }
  const std::int64_t nq = cache.quantised_dim();
  core::for_each_scale_group(cache, record, [&](std::int64_t i0, std::int64_t i1, float scale) {
    kernel.run(record + i0, i1 - i0, scale, out + i0);
  });
  std::memcpy(out + nq, record + cache.fp8_rope_offset(), 2 * l.rope_dim);  // the RoPE part: bf16 already
}

void record_to_f32(const core::PagedCache& cache, const std::uint8_t* record, float* out, const Fp8Dequant& kernel) {
  // A bf16 record widened is core::decode_token's; an fp32 one never meets a bf16
  // kernel (kernel_dtype is fp32 where any cache is).
  if (cache.layout.dtype != CacheDType::fp8_e4m3) return core::decode_token(cache, record, out);
  core::for_each_scale_group(cache, record, [&](std::int64_t i0, std::int64_t i1, float scale) {
    kernel.run_f32(record + i0, i1 - i0, scale, out + i0);
  });
  core::decode_rope(cache, record, out + cache.quantised_dim());
}

}  // namespace dsa::cpu::dequant
