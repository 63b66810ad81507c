// Smallest useful dsa program: the lightning indexer's top-2 keys per query over two
// packed causal sequences (3 and 5 tokens), checked against the scores computed here.
// README's C++ section is this file; examples/consumer builds it against an installed
// dsa (find_package), and `make test` runs it.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "dsa/dsa.h"

int main() {
  const std::int64_t T = 8, Hi = 2, Di = 4, topk = 2;
  std::vector<float> q(T * Hi * Di), k(T * Di), w(T * Hi);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 7) % 11) * 0.25f - 1.0f;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 5) % 13) * 0.2f - 1.1f;
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + static_cast<float>(i % 3) * 0.25f;
  std::vector<std::int32_t> indices(T * topk);
  std::vector<float> scores(T * topk);

  dsa::IndexerParams params;
  params.topk = topk;
  params.cu_seqlens_q = {0, 3, 8};  // C++ takes cu_seqlens: a leading 0, then the ends
  params.cu_seqlens_k = {0, 3, 8};
  try {
    dsa::indexer_topk(dsa::make_view(q.data(), dsa::DType::f32, {T, Hi, Di}),
                      dsa::make_view(k.data(), dsa::DType::f32, {T, Di}),
                      dsa::make_view(w.data(), dsa::DType::f32, {T, Hi}), params,
                      dsa::make_view(indices.data(), dsa::DType::i32, {T, topk}),
                      dsa::make_view(scores.data(), dsa::DType::f32, {T, topk}), dsa::Backend::cpu);
  } catch (const dsa::Error& e) {  // each names the argument at fault
    std::fprintf(stderr, "dsa error: %s\n", e.what());
    return 1;
  }

  // The same selection by hand: I(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) over the
  // keys s <= t of t's own sequence, the two largest in ascending position, -1 after.
  int wrong = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t first = t < 3 ? 0 : 3;
    std::vector<std::pair<float, std::int32_t>> ranked;
    for (std::int64_t s = first; s <= t; ++s) {
      float score = 0.0f;
      for (std::int64_t h = 0; h < Hi; ++h) {
        float dot = 0.0f;
        for (std::int64_t d = 0; d < Di; ++d) dot += q[(t * Hi + h) * Di + d] * k[s * Di + d];
        score += w[t * Hi + h] * std::max(dot, 0.0f);
      }
      ranked.push_back({-score, static_cast<std::int32_t>(s - first)});  // ties: the smaller position
    }
    std::sort(ranked.begin(), ranked.end());
    std::vector<std::int32_t> want;
    for (std::size_t i = 0; i < ranked.size() && i < static_cast<std::size_t>(topk); ++i)
      want.push_back(ranked[i].second);
    std::sort(want.begin(), want.end());
    want.resize(topk, -1);
    std::printf("query %lld -> keys %d (%.3f), %d (%.3f)\n", static_cast<long long>(t), indices[t * topk],
                scores[t * topk], indices[t * topk + 1], scores[t * topk + 1]);
    wrong += !std::equal(want.begin(), want.end(), indices.begin() + t * topk);
  }
  return wrong == 0 ? 0 : 1;
}
