// Reference backend of cache_write / cache_gather: the FP8 format written out
// from its definition (nearest of the 255 codes by search, scales by log2),
// independent of the bit-level codec the fused kernels use (core/fp8.h).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/numeric.h"
#include "ops/paged_cache.h"

namespace dsa::reference {
namespace {

double e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double magnitude = e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return code & 0x80 ? -magnitude : magnitude;
}

std::uint8_t e4m3_nearest(float x) {
  if (std::isnan(x)) return 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {  // 0x7f is NaN
    const double d = std::fabs(e4m3_value(c) - a), bd = std::fabs(e4m3_value(best) - a);
    if (d < bd || (d == bd && (c & 1) == 0)) best = c;  // a tie goes to the even code
  }
  return static_cast<std::uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

float group_scale(float amax) {
  if (std::isnan(amax) || std::isinf(amax)) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 1.0f;
  const double k = std::ceil(std::log2(static_cast<double>(amax) / 448.0));
  return static_cast<float>(std::pow(2.0, std::max(k, -126.0)));
}

}  // namespace

void cache_write(const CacheRowsProblem& p) {
  const CacheLayout& l = p.cache.layout;
  const std::int64_t nq = l.dim - l.rope_dim;
  std::vector<float> v(l.dim);
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    if (p.slots[r] < 0) continue;
    for (std::int64_t i = 0; i < l.dim; ++i) v[i] = core::load_float(p.values, p.dtype, p.offset(r) + i);
    std::uint8_t* rec = p.cache.token(p.slots[r]);
    if (l.dtype == CacheDType::f32) {
      for (std::int64_t i = 0; i < l.dim; ++i) std::memcpy(rec + 4 * i, &v[i], 4);
      continue;
    }
    if (l.dtype == CacheDType::bf16) {
      for (std::int64_t i = 0; i < l.dim; ++i) {
        const std::uint16_t bits = core::float_to_bf16(v[i]);
        std::memcpy(rec + 2 * i, &bits, 2);
      }
      continue;
    }
    std::int64_t group = 0;
    for (std::int64_t i0 = 0; i0 < nq; i0 += kCacheScaleGroup, ++group) {
      const std::int64_t i1 = std::min(nq, i0 + kCacheScaleGroup);
      float amax = 0.0f;
      bool nan = false;
      for (std::int64_t i = i0; i < i1; ++i) {
        nan = nan || std::isnan(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : group_scale(amax);
      std::memcpy(rec + nq + 4 * group, &scale, 4);
      for (std::int64_t i = i0; i < i1; ++i) rec[i] = e4m3_nearest(v[i] / scale);
    }
    for (std::int64_t i = 0; i < l.rope_dim; ++i) {
      const std::uint16_t bits = core::float_to_bf16(v[nq + i]);
      std::memcpy(rec + nq + 4 * group + 2 * i, &bits, 2);
    }
  }
}

void cache_gather(const CacheRowsProblem& p) {
  const CacheLayout& l = p.cache.layout;
  const std::int64_t nq = l.dim - l.rope_dim, groups = (nq + kCacheScaleGroup - 1) / kCacheScaleGroup;
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    for (std::int64_t i = 0; i < l.dim; ++i) {
      float v = 0.0f;
      if (p.slots[r] >= 0) {
        const std::uint8_t* rec = p.cache.token(p.slots[r]);
        std::uint16_t bits;
        if (l.dtype == CacheDType::f32) {
          std::memcpy(&v, rec + 4 * i, 4);
        } else if (l.dtype == CacheDType::bf16) {
          std::memcpy(&bits, rec + 2 * i, 2);
          v = core::bf16_to_float(bits);
        } else if (i < nq) {
          float scale;
          std::memcpy(&scale, rec + nq + 4 * (i / kCacheScaleGroup), 4);
          const int code = rec[i];
          v = (code & 0x7f) == 0x7f ? std::numeric_limits<float>::quiet_NaN()
                                    : static_cast<float>(e4m3_value(code) * scale);
        } else {
          std::memcpy(&bits, rec + nq + 4 * groups + 2 * (i - nq), 2);
          v = core::bf16_to_float(bits);
        }
      }
      core::store_float(p.values, p.dtype, r * l.dim + i, v);
    }
  }
}

}  // namespace dsa::reference
