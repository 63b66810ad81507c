// Lightning indexer with top-k selection (docs/ops.md 4.1).
//
//   I[t, s] = scale * sum_j weights[t, j] * max(0, q[t, j] . k[s])
//
// per query, the min(topk, #visible) visible keys with the largest I; indices
// local to the query's sequence, valid entries first in ascending position,
// then -1. Keys are raw (cmp_ratio == 1) or compressed entries (cmp_ratio > 1).
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

struct IndexerParams {
  std::int64_t topk = 0;
  float scale = 1.0f;
  std::int64_t cmp_ratio = 1;
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens_q;  // empty: one full sequence (TND) / full rows (BSND)
  CuSeqlens cu_seqlens_k;  // raw key lengths; empty: full, or equal to the query
                           // lengths when cmp_ratio > 1 (self-attention)
  int num_threads = 0;     // 0: default_num_threads()
};

// Shapes (TND | BSND):
//   index_query [T, Hi, Di]        | [B, Sq, Hi, Di]   bf16, fp16 or fp32
//   index_key   [S, Di] / [S,1,Di] | [B, Sk, Di] / [B, Sk, 1, Di], same dtype
//   weights     [T, Hi]            | [B, Sq, Hi]       bf16, fp16 or fp32
//   indices     [T, topk]          | [B, Sq, topk]     int32, written
//   scores      like indices, fp32, written; may be absent
// Rows that belong to no sequence (BSND padding) get -1 / -inf.
void indexer_topk(const TensorView& index_query, const TensorView& index_key,
                  const TensorView& weights, const IndexerParams& params,
                  const TensorView& indices, const TensorView& scores = TensorView{},
                  Backend backend = Backend::automatic);

}  // namespace dsa
