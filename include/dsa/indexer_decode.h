// Paged decode indexer (docs/serving.md): the lightning indexer's scores and
// top-k for the new rows of each request, over its index keys in a paged cache.
//
// Request b holds context_lens[b] keys (cmp_ratio == 1: raw tokens; > 1: the
// compressed entries of a V4 CSA layer, one per cmp_ratio tokens) and asks for
// next_n >= 1 rows, the last next_n of its context: row j sits at raw position
//   p(b, j) = context_lens[b] - next_n + j
// and sees raw keys 0..p(b, j) (cmp_ratio == 1), or the compressed entries
// w < (p(b, j) + 1) / cmp_ratio, of which the cache holds
// context_lens[b] / cmp_ratio. next_n > 1 verifies speculative or
// multi-token-prediction drafts in one call.
//
//   I[b, j, s] = scale * sum_h weights[b, j, h] * max(0, q[b, j, h] . k[b, s])
//
// Per row, the min(topk, visible) visible keys with the largest I, as positions
// in the request's key stream, ascending, then -1 (dsa_indexer's result on the
// gathered keys; equal scores keep the smaller position). The scores stream
// through a per-thread tile and a running top-k: no [B, context] buffer.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa {

struct IndexerDecodeParams {
  std::int64_t topk = 0;
  float scale = 1.0f;
  std::int64_t cmp_ratio = 1;  // 1: raw keys; > 1: compressed keys (V4 CSA)
  CacheLayout key_layout;      // dim = Di, rope_dim 0 (an index key has no separate rope part)
  int num_threads = 0;         // 0: default_num_threads()
};

//   index_query   [B, next_n, Hi, Di]  bf16, fp16 or fp32, unit stride in Di
//   weights       [B, next_n, Hi]      bf16, fp16 or fp32
//   key_cache     [num_blocks, block_size, token_bytes] uint8 (paged_cache.h)
//   block_table   [B, width] int32
//   context_lens  [B] int32 or int64, each >= next_n
//   indices       [B, next_n, topk] int32, contiguous, written
// bf16 queries over a bf16 or FP8 cache are scored in bf16 (FP8 codes times
// their power-of-two scales are bf16 values exactly, but for values under 2^-130:
// docs/serving.md); anything else in fp32.
void indexer_decode(const TensorView& index_query, const TensorView& weights, const TensorView& key_cache,
                    const TensorView& block_table, const TensorView& context_lens,
                    const IndexerDecodeParams& params, const TensorView& indices,
                    Backend backend = Backend::automatic);

}  // namespace dsa
