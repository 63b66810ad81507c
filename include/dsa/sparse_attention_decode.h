// Sparse decode attention over paged caches (docs/serving.md): DeepSeek-V3.2's
// absorbed MLA (H query heads, one shared latent KV head) and DeepSeek-V4's
// window + compressed entries + sinks, for the new rows of each request.
//
// Request b holds context_lens[b] tokens; its row j (of next_n >= 1) is raw
// position p(b, j) = context_lens[b] - next_n + j. Attended set of a row:
//   raw part, from kv_cache: `indices` if given (positions, e.g. the decode
//     indexer's top-k; -1 and, with topk_lens, entries at or past topk_lens[b]
//     are skipped, and so is a position > p(b, j); a used entry outside
//     [-1, context_lens[b]) is an error naming it), else the
//     band p(b, j) - window + 1 .. p(b, j) (window 0: every token, dense);
//   compressed part (V4, cmp_cache given): `cmp_indices` if given (CSA:
//     positions in the compressed stream, in [-1, context_lens[b] / cmp_ratio),
//     entries not yet visible to the row skipped), else every visible entry (HCA);
//     entry w is visible to a row when w < (p(b, j) + 1) / cmp_ratio, and the
//     cache holds context_lens[b] / cmp_ratio entries.
// A key is the whole cached token (dim values: 512 latent + 64 RoPE for V3.2),
// its value the first d_v of them. Logits scale * q . k; softmax in fp32;
//   out = sum_j exp(l_j - m) v_j / (sum_j exp(l_j - m) + exp(sink_h - m))
//   lse = m + log(sum_j exp(l_j - m))    (without the sink)
// An empty row: out 0, lse -inf. This is dsa_sparse_attention on the gathered
// rows, its lse = softmax_max + log(softmax_sum).
//
// The attended keys are cut into fixed chunks whose partial softmaxes merge in
// chunk order, so a batch of one request uses every core and the result is the
// same bits for any thread count.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa {

struct SparseAttentionDecodeParams {
  float scale = 1.0f;
  std::int64_t d_v = 0;        // value dims (the first d_v of a key); 0: all
  std::int64_t window = 0;     // the band when `indices` is absent; 0: every token
  std::int64_t cmp_ratio = 1;  // > 1 exactly when cmp_cache is given
  CacheLayout kv_layout;       // of kv_cache (ring: V4's window cache)
  CacheLayout cmp_layout;      // of cmp_cache (same dim as kv_layout)
  int num_threads = 0;         // 0: default_num_threads()
};

// Absent views are optional.
//   query           [B, next_n, H, D]   bf16, fp16 or fp32, unit stride in D
//   kv_cache        paged cache of D values per token, block_table [B, width] int32
//   context_lens    [B] int32 or int64, each >= next_n
//   indices         [B, next_n, K] int32 positions
//   topk_lens       [B] int32 or int64 (only with indices): entries used per row
//   cmp_cache       paged cache of compressed entries, cmp_block_table [B, width'] int32
//   cmp_indices     [B, next_n, Kc] int32 positions in the compressed stream
//   sinks           [H] fp32
struct SparseAttentionDecodeInputs {
  TensorView query, kv_cache, block_table, context_lens, indices, topk_lens;
  TensorView cmp_cache, cmp_block_table, cmp_indices, sinks;
};

// Outputs (written, contiguous):
//   out  [B, next_n, H, d_v]  dtype of query
//   lse  [B, next_n, H]       fp32
void sparse_attention_decode(const SparseAttentionDecodeInputs& inputs, const SparseAttentionDecodeParams& params,
                             const TensorView& out, const TensorView& lse, Backend backend = Backend::automatic);

}  // namespace dsa
