// Shared by the decode ops' tests: a paged cache filled through cache_write
// with random rows under a shuffled block table (no block shared).
#pragma once

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

#include "dsa/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa_testing {

struct PagedFixture {
  dsa::CacheLayout layout;
  std::int64_t block_size = 16, width = 0, blocks = 0, batch = 0;
  std::vector<std::uint8_t> cache;
  std::vector<std::int32_t> table;

  // Request b holds lens[b] random rows (normal, times `spread`).
  PagedFixture(dsa::CacheLayout l, std::int64_t bs, const std::vector<std::int64_t>& lens, std::uint32_t seed)
      : layout(l), block_size(bs), batch(static_cast<std::int64_t>(lens.size())) {
    for (std::int64_t n : lens) width = std::max(width, (n + bs - 1) / bs);
    width = std::max<std::int64_t>(width, 1);
    blocks = batch * width + 2;
    cache.assign(blocks * bs * dsa::cache_token_bytes(l), 0);
    std::vector<std::int32_t> ids(blocks);
    for (std::int64_t i = 0; i < blocks; ++i) ids[i] = static_cast<std::int32_t>(i);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + batch * width);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::int64_t b = 0; b < batch; ++b) {
      std::vector<float> values(lens[b] * l.dim);
      for (auto& v : values) v = normal(rng);
      write(b, 0, values);
    }
  }
  // Writes rows [first, first + values / dim) of request b.
  void write(std::int64_t b, std::int64_t first, std::vector<float> values) {
    const std::int64_t n = static_cast<std::int64_t>(values.size()) / layout.dim;
    std::vector<std::int32_t> pos(n);
    for (std::int64_t i = 0; i < n; ++i) pos[i] = static_cast<std::int32_t>(first + i);
    dsa::CacheWriteParams params;
    params.layout = layout;
    dsa::cache_write(cache_view(), dsa::make_view(table.data() + b * width, dsa::DType::i32, {1, width}),
                     dsa::make_view(pos.data(), dsa::DType::i32, {1, n}),
                     dsa::make_view(values.data(), dsa::DType::f32, {1, n, layout.dim}), params);
  }
  dsa::TensorView cache_view() {
    return dsa::make_view(cache.data(), dsa::DType::u8, {blocks, block_size, dsa::cache_token_bytes(layout)});
  }
  dsa::TensorView table_view() { return dsa::make_view(table.data(), dsa::DType::i32, {batch, width}); }
};

// Random values of a float dtype, as raw storage (bf16 bits or fp32).
inline std::vector<std::uint16_t> random_bf16(std::int64_t n, std::uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<std::uint16_t> out(n);
  for (auto& x : out) {
    const float f = u(rng);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  return out;
}

}  // namespace dsa_testing
