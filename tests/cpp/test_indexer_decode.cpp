// indexer_decode: the fused CPU backend on every ISA path against the
// reference (bf16 and FP8 key caches, raw and compressed keys, next_n up to
// 17, one long request split over threads), the same bits for any thread
// count. The comparison with dsa_indexer on gathered keys is
// tests/python/test_decode.py.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "decode_fixture.h"
#include "dsa/indexer_decode.h"
#include "isa_paths.h"

namespace {

using dsa::CacheDType;
using dsa::DType;
using dsa_testing::PagedFixture;

std::vector<std::int32_t> run(CacheDType cache, std::int64_t next_n, std::int64_t ratio, dsa::Backend backend,
                              int threads) {
  const std::int64_t H = 16, D = 64, topk = 64;
  const std::vector<std::int64_t> ctx = {next_n * ratio + 3, 333, 9000};
  const std::int64_t B = static_cast<std::int64_t>(ctx.size());
  std::vector<std::int64_t> held;
  for (auto n : ctx) held.push_back(n / ratio);
  PagedFixture keys({cache, D, 0, false}, 64, held, 5);
  auto q = dsa_testing::random_bf16(B * next_n * H * D, 6, -1.0f, 1.0f);
  auto w = dsa_testing::random_bf16(B * next_n * H, 7, 0.0f, 1.0f);
  std::vector<std::int64_t> lens = ctx;
  dsa::IndexerDecodeParams params;
  params.topk = topk;
  params.scale = 0.125f;
  params.cmp_ratio = ratio;
  params.key_layout = {cache, D, 0, false};
  params.num_threads = threads;
  std::vector<std::int32_t> out(B * next_n * topk);
  dsa::indexer_decode(dsa::make_view(q.data(), DType::bf16, {B, next_n, H, D}),
                      dsa::make_view(w.data(), DType::bf16, {B, next_n, H}), keys.cache_view(), keys.table_view(),
                      dsa::make_view(lens.data(), DType::i64, {B}), params,
                      dsa::make_view(out.data(), DType::i32, {B, next_n, topk}), backend);
  return out;
}

TEST(IndexerDecode, EveryIsaMatchesTheReferenceWithTheSameBitsForAnyThreadCount) {
  const std::int64_t topk = 64;
  for (CacheDType cache : {CacheDType::bf16, CacheDType::fp8_e4m3})
    for (std::int64_t next_n : {1, 17})
      for (std::int64_t ratio : {1, 4}) {
        const auto ref = run(cache, next_n, ratio, dsa::Backend::reference, 1);
        for (dsa::core::Isa isa : dsa_testing::distinct_paths()) {
          dsa_testing::IsaLimit limit(isa);
          SCOPED_TRACE(std::string(dsa::core::isa_name(isa)) + " cache " + dsa::cache_dtype_name(cache) +
                       " next_n " + std::to_string(next_n) + " ratio " + std::to_string(ratio));
          const auto one = run(cache, next_n, ratio, dsa::Backend::cpu, 1);
          EXPECT_EQ(one, run(cache, next_n, ratio, dsa::Backend::cpu, 2));
          // fp32 sums against the reference's float64: near ties may swap.
          for (std::size_t r = 0; r < one.size() / topk; ++r) {
            std::set<std::int32_t> a(one.begin() + r * topk, one.begin() + (r + 1) * topk),
                b(ref.begin() + r * topk, ref.begin() + (r + 1) * topk);
            std::vector<std::int32_t> diff;
            std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(diff));
            EXPECT_LE(diff.size(), 2u) << "row " << r;
            EXPECT_TRUE(std::is_sorted(one.begin() + r * topk,
                                       std::find(one.begin() + r * topk, one.begin() + (r + 1) * topk, -1)));
          }
        }
      }
}

}  // namespace
