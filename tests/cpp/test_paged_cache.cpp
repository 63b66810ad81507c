// Paged caches: the FP8 e4m3 codec, cache_write / cache_gather on both
// backends, and their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "cpu/paged_cache/dequant.h"
#include "dsa/error.h"
#include "dsa/paged_cache.h"
#include "isa_paths.h"

namespace {

using dsa::Backend;
using dsa::CacheDType;
using dsa::CacheLayout;
using dsa::DType;

TEST(PagedCache, TokenBytesOfTheDeepSeekLayouts) {
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::f32, 576, 64}), 2304);
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::bf16, 576, 64}), 1152);       // V3.2 latent
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::fp8_e4m3, 576, 64}), 656);    // FlashMLA's record
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::bf16, 128, 0}), 256);         // indexer key
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::fp8_e4m3, 128, 0}), 132);     // DeepGEMM's bytes
  EXPECT_EQ(dsa::cache_token_bytes({CacheDType::fp8_e4m3, 512, 64}), 448 + 16 + 128);  // V4: 448 in 4 groups
  EXPECT_THROW(dsa::cache_token_bytes({CacheDType::bf16, 0, 0}), dsa::Error);
  EXPECT_THROW(dsa::cache_token_bytes({CacheDType::fp8_e4m3, 64, 65}), dsa::Error);
}

// Every code decodes to itself: encode(decode(c)) == c for the 254 non-NaN codes.
TEST(PagedCache, E4m3RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = dsa::core::e4m3_table()[c];
    EXPECT_EQ(dsa::core::float_to_e4m3(v), c) << "code " << c << " value " << v;
  }
  EXPECT_TRUE(std::isnan(dsa::core::e4m3_table()[0x7f]));
  EXPECT_EQ(dsa::core::e4m3_table()[0x7e], 448.0f);
  EXPECT_EQ(dsa::core::e4m3_table()[0x01], 0x1p-9f);
}

// Midpoints between neighbouring codes round to the even one; a hair above
// rounds up. Covers subnormals, the normal range and the top.
TEST(PagedCache, E4m3RoundsHalfToEven) {
  const auto& t = dsa::core::e4m3_table();
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = t[c], hi = t[c + 1], mid = 0.5f * (lo + hi);
    const int even = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(dsa::core::float_to_e4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(dsa::core::float_to_e4m3(std::nextafter(mid, 1e9f)), c + 1);
    EXPECT_EQ(dsa::core::float_to_e4m3(std::nextafter(mid, -1e9f)), c);
    EXPECT_EQ(dsa::core::float_to_e4m3(-mid), even | 0x80);
  }
  EXPECT_EQ(dsa::core::float_to_e4m3(1e6f), 0x7e);  // saturates
}

TEST(PagedCache, ScalesArePowersOfTwoThatFit) {
  EXPECT_EQ(dsa::core::e4m3_group_scale(448.0f), 1.0f);
  EXPECT_EQ(dsa::core::e4m3_group_scale(std::nextafter(448.0f, 1e9f)), 2.0f);
  EXPECT_EQ(dsa::core::e4m3_group_scale(1.0f), 0x1p-8f);  // 1 / 2^-8 = 256 <= 448
  EXPECT_EQ(dsa::core::e4m3_group_scale(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(dsa::core::e4m3_group_scale(std::numeric_limits<float>::infinity())));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exp(-60.0f, 60.0f);
  for (int i = 0; i < 2000; ++i) {
    const float amax = std::exp2(exp(rng));
    const float s = dsa::core::e4m3_group_scale(amax);
    EXPECT_LE(amax / s, 448.0f);
    EXPECT_GT(amax / s, 224.0f);
    int e = 0;
    EXPECT_EQ(std::frexp(s, &e), 0.5f);  // a power of two
  }
}

// A cache and its block table: `blocks` blocks, request b owning the blocks
// listed in its row of the table (a permutation, so no two share a block).
struct Fixture {
  CacheLayout layout;
  std::int64_t block_size, blocks, batch, width;
  std::vector<std::uint8_t> cache;
  std::vector<std::int32_t> table;

  Fixture(CacheLayout l, std::int64_t bs, std::int64_t b, std::int64_t w, std::uint32_t seed)
      : layout(l), block_size(bs), blocks(b * w + 1), batch(b), width(w) {
    cache.assign(blocks * bs * dsa::cache_token_bytes(l), 0xAB);
    std::vector<std::int32_t> ids(blocks);
    for (std::int64_t i = 0; i < blocks; ++i) ids[i] = static_cast<std::int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
    table.assign(ids.begin(), ids.begin() + b * w);
  }
  dsa::TensorView cache_view() {
    return dsa::make_view(cache.data(), DType::u8, {blocks, block_size, dsa::cache_token_bytes(layout)});
  }
  dsa::TensorView table_view() { return dsa::make_view(table.data(), DType::i32, {batch, width}); }
};

std::vector<float> random_values(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exp(-20.0f, 20.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng) * std::exp2(exp(rng) * (rng() % 4 == 0));
  return v;
}

// Writes [B, n, dim] rows at positions through both backends: the caches must
// be identical byte for byte, and gathering them back gives the same values.
void check_write_and_gather(CacheLayout layout, std::int64_t block_size, std::int64_t batch, std::int64_t n,
                            std::uint32_t seed) {
  SCOPED_TRACE(std::string(dsa::cache_dtype_name(layout.dtype)) + " dim " + std::to_string(layout.dim) +
               " rope " + std::to_string(layout.rope_dim) + " block " + std::to_string(block_size));
  const std::int64_t width = (n + block_size - 1) / block_size + 1;
  Fixture ref(layout, block_size, batch, width, seed), fused(layout, block_size, batch, width, seed);
  std::vector<float> values = random_values(batch * n * layout.dim, seed);
  values[0] = 0.0f;
  values[1] = -0.0f;
  std::vector<std::int32_t> positions(batch * n);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i) positions[b * n + i] = (i % 5 == 3) ? -1 : static_cast<std::int32_t>(i + b);
  const auto vv = dsa::make_view(values.data(), DType::f32, {batch, n, layout.dim});
  const auto pv = dsa::make_view(positions.data(), DType::i32, {batch, n});
  dsa::CacheWriteParams params;
  params.layout = layout;
  dsa::cache_write(ref.cache_view(), ref.table_view(), pv, vv, params, Backend::reference);
  for (int threads : {1, 2}) {
    params.num_threads = threads;
    dsa::cache_write(fused.cache_view(), fused.table_view(), pv, vv, params, Backend::cpu);
    ASSERT_EQ(ref.cache, fused.cache) << threads << " threads";
  }
  std::vector<float> back_ref(values.size()), back_cpu(values.size());
  dsa::cache_gather(ref.cache_view(), ref.table_view(), pv, params,
                    dsa::make_view(back_ref.data(), DType::f32, {batch, n, layout.dim}), Backend::reference);
  dsa::cache_gather(fused.cache_view(), fused.table_view(), pv, params,
                    dsa::make_view(back_cpu.data(), DType::f32, {batch, n, layout.dim}), Backend::cpu);
  for (std::size_t i = 0; i < values.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(back_ref[i]), std::bit_cast<std::uint32_t>(back_cpu[i])) << i;
  // Against the values: skipped rows read 0; bf16 within half an ulp; FP8 within
  // half an e4m3 step at the value's magnitude, or the subnormal step of its group.
  const std::int64_t nq = layout.dim - layout.rope_dim;
  for (std::int64_t r = 0; r < batch * n; ++r)
    for (std::int64_t i = 0; i < layout.dim; ++i) {
      const float x = values[r * layout.dim + i], y = back_cpu[r * layout.dim + i];
      if (positions[r] < 0) {
        ASSERT_EQ(y, 0.0f);
        continue;
      }
      if (layout.dtype == CacheDType::f32) {
        ASSERT_EQ(x, y) << r << " " << i;
        continue;
      }
      if (layout.dtype == CacheDType::bf16 || i >= nq) {
        ASSERT_LE(std::fabs(x - y), std::fabs(x) * 0x1p-8f) << r << " " << i;
        continue;
      }
      const std::int64_t g0 = i / dsa::kCacheScaleGroup * dsa::kCacheScaleGroup;
      float amax = 0.0f;
      for (std::int64_t j = g0; j < std::min(nq, g0 + dsa::kCacheScaleGroup); ++j)
        amax = std::max(amax, std::fabs(values[r * layout.dim + j]));
      const float scale = dsa::core::e4m3_group_scale(amax);
      ASSERT_LE(std::fabs(x - y), std::max(std::fabs(x) * 0x1p-4f, scale * 0x1p-10f)) << r << " " << i;
    }
}

TEST(PagedCache, WriteAndGatherMatchTheReference) {
  check_write_and_gather({CacheDType::f32, 576, 64}, 64, 2, 30, 6);
  check_write_and_gather({CacheDType::bf16, 576, 64}, 64, 3, 70, 1);
  check_write_and_gather({CacheDType::fp8_e4m3, 576, 64}, 64, 3, 70, 2);
  check_write_and_gather({CacheDType::fp8_e4m3, 128, 0}, 16, 2, 40, 3);
  check_write_and_gather({CacheDType::fp8_e4m3, 512, 64}, 8, 2, 19, 4);  // a short last group
  check_write_and_gather({CacheDType::fp8_e4m3, 100, 0}, 1, 1, 5, 5);    // one group, block size 1
}

TEST(PagedCache, NanReadsBackAsNan) {
  Fixture f({CacheDType::fp8_e4m3, 128, 0}, 4, 1, 1, 0);
  std::vector<float> v(128, 1.0f);
  v[7] = std::numeric_limits<float>::quiet_NaN();
  std::int32_t pos = 2;
  dsa::CacheWriteParams params;
  params.layout = f.layout;
  for (Backend b : {Backend::reference, Backend::cpu}) {
    dsa::cache_write(f.cache_view(), f.table_view(), dsa::make_view(&pos, DType::i32, {1, 1}),
                     dsa::make_view(v.data(), DType::f32, {1, 1, 128}), params, b);
    std::vector<float> back(128);
    dsa::cache_gather(f.cache_view(), f.table_view(), dsa::make_view(&pos, DType::i32, {1, 1}), params,
                      dsa::make_view(back.data(), DType::f32, {1, 1, 128}), b);
    EXPECT_TRUE(std::isnan(back[7]));
  }
}

TEST(PagedCache, RingTableReusesItsColumns) {
  // Width 2, block 4: position 9 lands in column (9 / 4) % 2 = 0.
  CacheLayout layout{CacheDType::bf16, 8, 0, true};
  Fixture f(layout, 4, 1, 2, 0);
  std::vector<float> v(8, 2.5f);
  std::int32_t pos = 9;
  dsa::CacheWriteParams params;
  params.layout = layout;
  dsa::cache_write(f.cache_view(), f.table_view(), dsa::make_view(&pos, DType::i32, {1, 1}),
                   dsa::make_view(v.data(), DType::f32, {1, 1, 8}), params, Backend::cpu);
  const std::int64_t slot = f.table[0] * 4 + 1;
  std::uint16_t bits;
  std::memcpy(&bits, f.cache.data() + slot * 16, 2);
  EXPECT_EQ(bits, 0x4020);  // 2.5 in bf16
}

void expect_argument_error(const std::function<void()>& call, const std::string& word) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming " << word;
  } catch (const dsa::Error& e) {
    EXPECT_EQ(e.kind(), dsa::ErrorKind::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

TEST(PagedCache, BadInputNamesTheArgument) {
  CacheLayout layout{CacheDType::fp8_e4m3, 128, 0};
  Fixture f(layout, 4, 2, 2, 0);
  std::vector<float> v(2 * 3 * 128, 1.0f);
  std::vector<std::int32_t> pos = {0, 1, 2, 0, 1, 2};
  dsa::CacheWriteParams params;
  params.layout = layout;
  auto write = [&](dsa::TensorView cache, dsa::TensorView table, std::vector<std::int32_t> p) {
    dsa::cache_write(cache, table, dsa::make_view(p.data(), DType::i32, {2, 3}),
                     dsa::make_view(v.data(), DType::f32, {2, 3, 128}), params, Backend::cpu);
  };
  write(f.cache_view(), f.table_view(), pos);  // fine
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), {0, 1, 8, 0, 1, 2}); }, "positions");
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), {0, 1, -2, 0, 1, 2}); }, "positions");
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), {0, 1, 1, 0, 1, 2}); }, "same cache slot");
  f.table[1] = static_cast<std::int32_t>(f.blocks);  // outside the cache
  write(f.cache_view(), f.table_view(), pos);          // column 1 is not read
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), {0, 1, 5, 0, 1, 2}); }, "block_table[0, 1]");
  f.table[1] = -1;
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), {0, 1, 5, 0, 1, 2}); }, "no block");
  write(f.cache_view(), f.table_view(), pos);  // column 1 is not needed
  auto wrong_bytes = dsa::make_view(f.cache.data(), DType::u8, {f.blocks, 2, 2 * 132 - 1});
  expect_argument_error([&] { write(wrong_bytes, f.table_view(), pos); }, "bytes per token");
  auto wrong_dtype = dsa::make_view(f.cache.data(), DType::bf16, {f.blocks, 4, 66});
  expect_argument_error([&] { write(wrong_dtype, f.table_view(), pos); }, "cache");
  params.layout.dim = 64;
  expect_argument_error([&] { write(f.cache_view(), f.table_view(), pos); }, "cache");
  EXPECT_THROW(dsa::parse_cache_dtype("int4"), dsa::Error);
  EXPECT_EQ(dsa::parse_cache_dtype("fp8"), CacheDType::fp8_e4m3);
}

// fuzz_decode's timeout (tests/fuzz/corpus/decode/timeout-be8973ca): rows
// [2^40, 0, dim], positions [2^40, 0] and a [2^40, 0] block table are legal
// empty views; validation looped over their 2^40 requests. It now reads only
// what the positions reach: such a call returns at once, a table view of 2^40
// columns (stride 0) costs nothing, and a bad id in a column nobody reads is
// no error.
TEST(PagedCache, ValidationReadsOnlyTheColumnsACallTouches) {
  CacheLayout layout{CacheDType::bf16, 8, 0};
  Fixture f(layout, 4, 1, 1, 0);
  {
    const std::int64_t huge = std::int64_t{1} << 40;
    dsa::CacheWriteParams empty_params;
    empty_params.layout = layout;
    float none = 0.0f;
    std::int32_t no_id = 0;
    dsa::cache_write(f.cache_view(), dsa::make_view(&no_id, DType::i32, {huge, 0}),
                     dsa::make_view(&no_id, DType::i32, {huge, 0}), dsa::make_view(&none, DType::f32, {huge, 0, 8}),
                     empty_params, Backend::cpu);
  }
  std::vector<float> v(2 * 8, 1.0f);
  std::vector<std::int32_t> pos = {0, 3};
  dsa::CacheWriteParams params;
  params.layout = layout;
  dsa::TensorView wide = dsa::make_view(f.table.data(), DType::i32, {1, 1});
  wide.shape[1] = std::int64_t{1} << 40;
  wide.strides[1] = 0;
  dsa::cache_write(f.cache_view(), wide, dsa::make_view(pos.data(), DType::i32, {1, 2}),
                   dsa::make_view(v.data(), DType::f32, {1, 2, 8}), params, Backend::cpu);
  std::vector<std::int32_t> table = {f.table[0], 1 << 30};  // column 1: outside the cache, never read
  dsa::cache_write(f.cache_view(), dsa::make_view(table.data(), DType::i32, {1, 2}),
                   dsa::make_view(pos.data(), DType::i32, {1, 2}), dsa::make_view(v.data(), DType::f32, {1, 2, 8}),
                   params, Backend::cpu);
  pos[1] = 4;  // now column 1 is read
  expect_argument_error(
      [&] {
        dsa::cache_write(f.cache_view(), dsa::make_view(table.data(), DType::i32, {1, 2}),
                         dsa::make_view(pos.data(), DType::i32, {1, 2}),
                         dsa::make_view(v.data(), DType::f32, {1, 2, 8}), params, Backend::cpu);
      },
      "block_table[0, 1]");
}

}  // namespace

// The decode kernels' FP8 -> bf16 pass: every ISA kernel writes the portable
// kernel's bits (core::float_to_bf16 of table * scale) for all 256 codes, at
// scales from tiny to huge and NaN: the powers of two dsa_cache_write stores
// (the AVX-512 kernel's integer route, 2^-117 .. 2^119, and either side of it)
// and any other scale (its fp32 route). Their fp32 outputs (run_f32) are the
// same values.
TEST(PagedCache, Fp8DequantKernelsAgreeOnEveryCode) {
  std::vector<std::uint8_t> codes(256 + 7);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(i * 37 + 11);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<std::uint8_t>(c);
  const auto& portable = dsa::cpu::dequant::portable_kernel();
  for (float scale : {1.0f, 0x1p-126f, 0x1p-118f, 0x1p-117f, 0x1p-4f, 0x1p20f, 0x1p119f, 0x1p120f, 0.3f, -0.5f,
                      -0x1p-4f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<std::uint16_t> want(codes.size()), got(codes.size());
    portable.run(codes.data(), static_cast<std::int64_t>(codes.size()), scale, want.data());
    for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
      dsa_testing::IsaLimit limit(isa);
      const auto& kernel = dsa::cpu::dequant::pick_fp8_dequant();
      std::fill(got.begin(), got.end(), 0);
      kernel.run(codes.data(), static_cast<std::int64_t>(codes.size()), scale, got.data());
      EXPECT_EQ(got, want) << kernel.name << " scale " << scale;
      // The fp32 route (the fp32 FMA kernels' keys): the same values widened,
      // bit for bit, except that a NaN need only be a NaN.
      std::vector<float> wide(codes.size(), 1.0f);
      kernel.run_f32(codes.data(), static_cast<std::int64_t>(codes.size()), scale, wide.data());
      for (std::size_t i = 0; i < codes.size(); ++i) {
        const float expect = dsa::core::bf16_to_float(want[i]);
        if (std::isnan(expect)) {
          EXPECT_TRUE(std::isnan(wide[i])) << kernel.name << " scale " << scale << " code " << int(codes[i]);
        } else {
          EXPECT_EQ(std::memcmp(&wide[i], &expect, 4), 0)
              << kernel.name << " scale " << scale << " code " << int(codes[i]) << ": " << wide[i] << " vs " << expect;
        }
      }
    }
  }
}
