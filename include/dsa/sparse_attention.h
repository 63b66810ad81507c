// Sparse attention with one shared KV head (docs/ops.md 4.2).
//
// Keys are all D dims of `kv` (plus `key_rope`), values its first d_v dims:
// K and V are the same tensor, so the backward's dkv carries both the key
// (dS * q) and the value (P^T * dO) contributions.
//
// Attended set of query i (raw key position pos(i), bottom-right aligned):
//   raw part:        `indices` if present (explicit top-k, DeepSeek-V3.2 sparse),
//                    else the causal band [pos(i) - window + 1, pos(i)]
//                    (window == 0: unbounded, i.e. dense causal);
//   compressed part: only with `cmp_kv` (cmp_ratio > 1, DeepSeek-V4):
//                    `cmp_indices` if present (CSA), else every visible
//                    compressed entry w < (pos(i) + 1) / cmp_ratio (HCA).
// Index entries are local to the query's sequence; -1 and an entry not visible
// (causality) are skipped; duplicates count as often as they appear. An entry
// outside [-1, the sequence's key count) (compressed entries for cmp_indices)
// is an invalid_argument error naming indices / cmp_indices, forward and
// backward: a global row passed for a position would otherwise go unnoticed.
//
// Logits l = scale * q_h . k. softmax_max / softmax_sum exclude the sinks;
// out = sum_j exp(l_j - max) v_j / (sum + exp(sink_h - max)).
// Empty rows: out 0, softmax_max -inf, softmax_sum 0, gradients 0.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

struct SparseAttentionParams {
  float scale = 1.0f;
  std::int64_t d_v = 0;        // value dims (first d_v of kv); 0: all D dims
  std::int64_t window = 0;     // raw band width when no indices; 0: unbounded (dense causal)
  std::int64_t cmp_ratio = 1;  // > 1 exactly when cmp_kv is given
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens_q;  // empty: one full sequence (TND) / full rows (BSND)
  CuSeqlens cu_seqlens_k;  // raw key lengths; empty: full
  int num_threads = 0;     // 0: default_num_threads()
};

// Inputs of both directions. Shapes (TND | BSND); absent views are optional.
//   query       [T, H, D]             | [B, Sq, H, D]        bf16, fp16 or fp32
//   kv          [S, D] / [S, 1, D]    | [B, Sk, D] / [B, Sk, 1, D], dtype of query
//   indices     [T, K] / [T, 1, K]    | [B, Sq, K] / [B, Sq, 1, K]      int32
//   cmp_kv      [S', D] / [S', 1, D]  | [B, Sk', D] / [B, Sk', 1, D], dtype of query
//               (TND: sequences back to back, key_length // cmp_ratio rows each)
//   cmp_indices [T, Kc] / [T, 1, Kc]  | [B, Sq, Kc] / ...                int32
//   sinks       [H]                                                    fp32
//   query_rope  [T, H, Dr]            | [B, Sq, H, Dr]        dtype of query
//   key_rope    [S, Dr] / [S, 1, Dr]  | [B, Sk, Dr] / ...     dtype of query
// query_rope and key_rope come together and cannot be combined with cmp_kv
// (compressed entries carry no separate rope part).
struct SparseAttentionInputs {
  TensorView query, kv, indices, cmp_kv, cmp_indices, sinks, query_rope, key_rope;
};

// Outputs (written, contiguous):
//   out         [T, H, d_v] | [B, Sq, H, d_v]   dtype of query
//   softmax_max [T, H]      | [B, Sq, H]        fp32
//   softmax_sum [T, H]      | [B, Sq, H]        fp32
void sparse_attention_fwd(const SparseAttentionInputs& inputs, const SparseAttentionParams& params,
                          const TensorView& out, const TensorView& softmax_max,
                          const TensorView& softmax_sum, Backend backend = Backend::automatic);

// grad_out, out: [T, H, d_v] (dtype of query); softmax_max/sum from the forward.
// Gradients (written, contiguous, shaped like their input; dtype of the input):
//   d_query, d_kv always; d_query_rope / d_key_rope iff the rope inputs are
//   given; d_cmp_kv iff cmp_kv is given; d_sinks (fp32 [H]) iff sinks are given.
struct SparseAttentionGrads {
  TensorView d_query, d_kv, d_cmp_kv, d_sinks, d_query_rope, d_key_rope;
};

void sparse_attention_bwd(const SparseAttentionInputs& inputs, const SparseAttentionParams& params,
                          const TensorView& grad_out, const TensorView& out,
                          const TensorView& softmax_max, const TensorView& softmax_sum,
                          const SparseAttentionGrads& grads, Backend backend = Backend::automatic);

}  // namespace dsa
