// sparse_attention_decode: the fused CPU backend on every ISA path against the
// reference (V3.2 top-k over bf16 and FP8 caches, V4 window ring + compressed +
// sinks), and the same bits for any thread count. The comparison with the
// prefill op on gathered rows and a float64 oracle is tests/python/test_decode.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/numeric.h"
#include "decode_fixture.h"
#include "dsa/sparse_attention_decode.h"
#include "isa_paths.h"
#include "nan_placement.h"

namespace {

using dsa::CacheDType;
using dsa::DType;
using dsa_testing::PagedFixture;

struct Result {
  std::vector<std::uint16_t> out;
  std::vector<float> lse;
};

// Where a non-finite value goes (none: finite data).
enum class Poison { none, query, key, cmp_key, sink };

struct Case {
  CacheDType cache;
  bool v4;
  std::int64_t next_n;
  Poison poison = Poison::none;
  float special = 0.0f;
};

Result run(const Case& c, dsa::Backend backend, int threads) {
  const std::int64_t H = 16, D = 128, dv = 96, rope = 32, topk = 300, ratio = 4;
  const std::vector<std::int64_t> lens = {c.next_n + 2, 700, 1900};
  const std::int64_t B = static_cast<std::int64_t>(lens.size());
  PagedFixture kv({c.cache, D, rope, false}, 16, lens, 1);
  std::vector<std::int64_t> cmp_lens;
  for (auto n : lens) cmp_lens.push_back(n / ratio);
  PagedFixture cmp({c.cache, D, rope, false}, 16, cmp_lens, 2);
  auto q = dsa_testing::random_bf16(B * c.next_n * H * D, 3, -1.0f, 1.0f);
  std::vector<std::int32_t> idx(B * c.next_n * topk), cidx(B * c.next_n * 40);
  std::mt19937 rng(4);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < c.next_n * topk; ++i)
      idx[b * c.next_n * topk + i] = static_cast<std::int32_t>(rng() % (lens[b] + 1)) - 1;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < c.next_n * 40; ++i)
      cidx[b * c.next_n * 40 + i] = static_cast<std::int32_t>(rng() % (lens[b] / ratio + 1)) - 1;
  std::vector<std::int64_t> ctx = lens;
  std::vector<float> sinks(H);
  for (std::int64_t h = 0; h < H; ++h) sinks[h] = 0.25f * static_cast<float>(h) - 2.0f;
  // One element of request 1's rows 640-659 (of 700: in V4's window, and surely in
  // some V3.2 rows' top-k), of its compressed entries 90-109, of its first query row,
  // or of a sink.
  std::vector<float> rows(20 * D, 0.5f);
  for (std::int64_t r = 0; r < 20; ++r) rows[r * D + 3] = c.special;
  if (c.poison == Poison::key) kv.write(1, 640, rows);
  if (c.poison == Poison::cmp_key) cmp.write(1, 90, rows);
  if (c.poison == Poison::query) q[(1 * c.next_n * H + 2) * D + 7] = dsa::core::float_to_bf16(c.special);
  if (c.poison == Poison::sink) sinks[2] = c.special;

  dsa::SparseAttentionDecodeInputs in;
  in.query = dsa::make_view(q.data(), DType::bf16, {B, c.next_n, H, D});
  in.kv_cache = kv.cache_view();
  in.block_table = kv.table_view();
  in.context_lens = dsa::make_view(ctx.data(), DType::i64, {B});
  dsa::SparseAttentionDecodeParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(D));
  params.d_v = dv;
  params.kv_layout = {c.cache, D, rope, false};
  params.num_threads = threads;
  if (c.v4) {
    params.window = 128;
    params.cmp_ratio = ratio;
    params.cmp_layout = params.kv_layout;
    in.cmp_cache = cmp.cache_view();
    in.cmp_block_table = cmp.table_view();
    in.cmp_indices = dsa::make_view(cidx.data(), DType::i32, {B, c.next_n, 40});
    in.sinks = dsa::make_view(sinks.data(), DType::f32, {H});
  } else {
    in.indices = dsa::make_view(idx.data(), DType::i32, {B, c.next_n, topk});
  }
  Result r;
  r.out.resize(B * c.next_n * H * dv);
  r.lse.resize(B * c.next_n * H);
  dsa::sparse_attention_decode(in, params, dsa::make_view(r.out.data(), DType::bf16, {B, c.next_n, H, dv}),
                               dsa::make_view(r.lse.data(), DType::f32, {B, c.next_n, H}), backend);
  return r;
}

TEST(SparseAttentionDecode, EveryIsaMatchesTheReferenceWithTheSameBitsForAnyThreadCount) {
  for (const Case c : {Case{CacheDType::bf16, false, 1}, Case{CacheDType::fp8_e4m3, false, 2},
                       Case{CacheDType::bf16, true, 3}, Case{CacheDType::fp8_e4m3, true, 1}}) {
    const Result ref = run(c, dsa::Backend::reference, 1);
    for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
      dsa_testing::IsaLimit limit(isa);
      SCOPED_TRACE(std::string(dsa::core::isa_name(isa)) + (c.v4 ? " v4" : " v32") + " cache " +
                   dsa::cache_dtype_name(c.cache) + " next_n " + std::to_string(c.next_n));
      const Result one = run(c, dsa::Backend::cpu, 1), two = run(c, dsa::Backend::cpu, 2);
      EXPECT_EQ(one.out, two.out);
      EXPECT_EQ(one.lse, two.lse);
      double worst = 0.0;
      for (std::size_t i = 0; i < ref.out.size(); ++i)
        worst = std::max<double>(worst, std::fabs(dsa::core::bf16_to_float(one.out[i]) -
                                                  dsa::core::bf16_to_float(ref.out[i])));
      EXPECT_LT(worst, 2e-2);  // bf16 outputs of |x| < 1: a couple of ulps
      for (std::size_t i = 0; i < ref.lse.size(); ++i) EXPECT_NEAR(one.lse[i], ref.lse[i], 1e-3) << i;
    }
  }
}

// Non-finite data reaches on every ISA path what it reaches in the reference:
// NaN and infinities in the same places, the numbers close. An infinite key
// element gives +-inf logits: +inf takes the max (exp(inf - inf) is NaN), -inf
// weighs exactly 0 and its infinite value makes 0 * inf = NaN; a +inf sink
// takes all the mass (outputs 0), a NaN one makes its head NaN.
std::vector<float> widen(const std::vector<std::uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (std::size_t i = 0; i < bf16.size(); ++i) out[i] = dsa::core::bf16_to_float(bf16[i]);
  return out;
}

TEST(SparseAttentionDecode, NonFiniteDataReachesWhatItReachesInTheReference) {
  for (const Case base : {Case{CacheDType::bf16, false, 2}, Case{CacheDType::fp8_e4m3, true, 1},
                          Case{CacheDType::f32, true, 2}})
    for (Poison poison : {Poison::query, Poison::key, Poison::cmp_key, Poison::sink})
      for (float special : {NAN, INFINITY, -INFINITY}) {
        if (!base.v4 && (poison == Poison::cmp_key || poison == Poison::sink)) continue;
        Case c = base;
        c.poison = poison;
        c.special = special;
        const Result ref = run(c, dsa::Backend::reference, 1);
        const std::vector<float> ref_out = widen(ref.out);
        const auto nonfinite = std::count_if(ref_out.begin(), ref_out.end(), [](float x) { return !std::isfinite(x); });
        // What reaches no output: a -inf sink (no sink) and a +inf one (zeros).
        const bool reaches = !(poison == Poison::sink && !std::isnan(special));
        EXPECT_EQ(nonfinite > 0, reaches) << static_cast<int>(poison) << " " << special;
        for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
          dsa_testing::IsaLimit limit(isa);
          SCOPED_TRACE(std::string(dsa::core::isa_name(isa)) + (c.v4 ? " v4" : " v32") + " cache " +
                       dsa::cache_dtype_name(c.cache) + " poison " + std::to_string(static_cast<int>(poison)) +
                       " value " + std::to_string(special));
          const Result one = run(c, dsa::Backend::cpu, 1);
          dsa_testing::expect_same_non_finite(widen(one.out), widen(ref.out), 0.0, 2e-2, "out");
          dsa_testing::expect_same_non_finite(one.lse, ref.lse, 0.0, 1e-3, "lse");
        }
      }
}

}  // namespace
