// Internal: paged caches after validation (dsa/paged_cache.h), the token
// codec every decode kernel shares, and the block-table walk.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fp8.h"
#include "core/numeric.h"
#include "dsa/paged_cache.h"

namespace dsa::core {

struct PagedCache {
  std::uint8_t* data = nullptr;
  std::int64_t num_blocks = 0, block_size = 0, token_bytes = 0;
  CacheLayout layout;

  std::int64_t quantised_dim() const { return layout.dim - layout.rope_dim; }
  std::int64_t scale_groups() const { return (quantised_dim() + kCacheScaleGroup - 1) / kCacheScaleGroup; }
  // Where an FP8 record's bf16 RoPE part starts: after its codes and fp32 scales.
  std::int64_t fp8_rope_offset() const { return quantised_dim() + 4 * scale_groups(); }
  std::uint8_t* token(std::int64_t slot) const { return data + slot * token_bytes; }
};

// A request's block table row. An entry is read only after require_covered
// checked it lies in [0, num_blocks).
struct BlockTable {
  const std::int32_t* data = nullptr;
  std::int64_t batch = 0, width = 0, row_stride = 0, col_stride = 0;
  std::int64_t block_size = 0, num_blocks = 0;
  bool ring = false;
  const char* name = "block_table";  // the argument, for errors (cmp_block_table for V4's compressed cache)

  std::int64_t block(std::int64_t b, std::int64_t column) const {
    return data[b * row_stride + column * col_stride];
  }
  std::int64_t column(std::int64_t pos) const { return ring ? (pos / block_size) % width : pos / block_size; }
  // The slot (block * block_size + row) of position `pos` of request b; the
  // caller checked with require_covered that the block exists.
  std::int64_t slot(std::int64_t b, std::int64_t pos) const {
    return block(b, column(pos)) * block_size + pos % block_size;
  }
};

// Validation (the op layer): the cache tensor against its layout, the block
// table's shape and entries, and that positions [first, end) of request b
// have blocks (`what` names the argument that asked for them).
PagedCache validate_paged_cache(const TensorView& cache, const CacheLayout& layout, const char* name);
BlockTable validate_block_table(const TensorView& block_table, std::int64_t batch, const PagedCache& cache,
                                const char* name);
void require_covered(const BlockTable& table, std::int64_t b, std::int64_t first, std::int64_t end,
                     const char* what);
// Per-request lengths ([B] int32 or int64, each in [0, limit]) as int64.
std::vector<std::int64_t> read_lengths(const TensorView& lengths, const char* name, std::int64_t batch,
                                       std::int64_t limit, const char* limit_what);

// The token codec. encode: `values` (fp32, dim of them) -> one record.
inline void encode_token(const PagedCache& cache, const float* values, std::uint8_t* record) {
  const CacheLayout& l = cache.layout;
  // Records need not be aligned (an FP8 record of an odd width puts its
  // scales and bf16 values at odd addresses): every multi-byte field moves by
  // memcpy, which x86 compiles to a plain unaligned load or store.
  if (l.dtype == CacheDType::f32) {
    std::memcpy(record, values, 4 * l.dim);
    return;
  }
  if (l.dtype == CacheDType::bf16) {
    for (std::int64_t i = 0; i < l.dim; ++i) {
      const std::uint16_t bits = float_to_bf16(values[i]);
      std::memcpy(record + 2 * i, &bits, 2);
    }
    return;
  }
  const std::int64_t nq = cache.quantised_dim(), groups = cache.scale_groups();
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::int64_t i0 = g * kCacheScaleGroup, i1 = std::min(nq, i0 + kCacheScaleGroup);
    float amax = 0.0f;
    for (std::int64_t i = i0; i < i1; ++i) amax = std::fmax(amax, std::fabs(values[i]));
    // fmax drops NaN: look for one so that the scale marks it.
    for (std::int64_t i = i0; i < i1; ++i)
      if (std::isnan(values[i])) amax = values[i];
    const float scale = e4m3_group_scale(amax);
    std::memcpy(record + nq + 4 * g, &scale, 4);
    for (std::int64_t i = i0; i < i1; ++i) record[i] = float_to_e4m3(values[i] / scale);
  }
  std::uint8_t* rope = record + cache.fp8_rope_offset();
  for (std::int64_t i = 0; i < l.rope_dim; ++i) {
    const std::uint16_t bits = float_to_bf16(values[nq + i]);
    std::memcpy(rope + 2 * i, &bits, 2);
  }
}

// An FP8 record's scale groups: fn(i0, i1, scale) for its quantised values [i0, i1).
template <class Fn>
inline void for_each_scale_group(const PagedCache& cache, const std::uint8_t* record, Fn&& fn) {
  const std::int64_t nq = cache.quantised_dim(), groups = cache.scale_groups();
  for (std::int64_t g = 0; g < groups; ++g) {
    float scale;
    std::memcpy(&scale, record + nq + 4 * g, 4);
    const std::int64_t i0 = g * kCacheScaleGroup;
    fn(i0, std::min(nq, i0 + kCacheScaleGroup), scale);
  }
}

// An FP8 record's bf16 RoPE part (after its codes and scales) as fp32 out[0, rope_dim).
inline void decode_rope(const PagedCache& cache, const std::uint8_t* record, float* out) {
  const std::uint8_t* rope = record + cache.fp8_rope_offset();
  for (std::int64_t i = 0; i < cache.layout.rope_dim; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, rope + 2 * i, 2);
    out[i] = bf16_to_float(bits);
  }
}

// decode: one record -> `dim` fp32 values (exact: an FP8 value times its
// power-of-two scale, or a bf16 value).
inline void decode_token(const PagedCache& cache, const std::uint8_t* record, float* out) {
  const CacheLayout& l = cache.layout;
  if (l.dtype == CacheDType::f32) {
    std::memcpy(out, record, 4 * l.dim);
    return;
  }
  if (l.dtype == CacheDType::bf16) {
    for (std::int64_t i = 0; i < l.dim; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, record + 2 * i, 2);
      out[i] = bf16_to_float(bits);
    }
    return;
  }
  const std::array<float, 256>& table = e4m3_table();
  for_each_scale_group(cache, record, [&](std::int64_t i0, std::int64_t i1, float scale) {
    for (std::int64_t i = i0; i < i1; ++i) out[i] = table[record[i]] * scale;
  });
  decode_rope(cache, record, out + cache.quantised_dim());
}

}  // namespace dsa::core
