// Smallest useful dsa program: top-2 keys per query of one causal sequence.
// Built against an installed dsa with find_package(dsa) (see examples/consumer).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "dsa/dsa.h"

int main() {
  const std::int64_t T = 4, Hi = 2, Di = 4, topk = 2;
  std::vector<float> q(T * Hi * Di), k(T * Di), w(T * Hi, 1.0f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 7) % 5) - 1.0f;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 3) % 4) - 1.0f;
  std::vector<std::int32_t> indices(T * topk);
  std::vector<float> scores(T * topk);

  dsa::IndexerParams params;
  params.topk = topk;
  params.cu_seqlens_q = {0, T};
  params.cu_seqlens_k = {0, T};
  try {
    dsa::indexer_topk(dsa::make_view(q.data(), dsa::DType::f32, {T, Hi, Di}),
                      dsa::make_view(k.data(), dsa::DType::f32, {T, Di}),
                      dsa::make_view(w.data(), dsa::DType::f32, {T, Hi}), params,
                      dsa::make_view(indices.data(), dsa::DType::i32, {T, topk}),
                      dsa::make_view(scores.data(), dsa::DType::f32, {T, topk}), dsa::Backend::cpu);
  } catch (const dsa::Error& e) {
    std::fprintf(stderr, "dsa error: %s\n", e.what());
    return 1;
  }
  for (std::int64_t t = 0; t < T; ++t)
    std::printf("query %lld -> keys %d (%.2f), %d (%.2f)\n", static_cast<long long>(t),
                indices[t * topk], scores[t * topk], indices[t * topk + 1], scores[t * topk + 1]);
  // Query 0 sees one key, so its second slot is padding.
  return indices[0] == 0 && indices[1] == -1 ? 0 : 1;
}
