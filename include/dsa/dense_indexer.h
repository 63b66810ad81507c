// Dense warm-up of the indexer (docs/ops.md 4.4): the main attention is dense,
// only the indexer trains, and no [T, S] tensor is ever built.
//
//   indexer_lse[t] = log sum_{visible s} exp(I[t, s])            (+inf for empty rows)
//   teacher p(t, s) = sum_h softmax_h(t, s) / H over visible keys, softmax_h from the
//                     dense attention's softmax_max / softmax_sum
//   student        = exp(I[t, s] - indexer_lse[t])
//   loss, reduction and gradients as in dsa/kl_loss.h:
//   dI = grad_loss * coefficient [/ N] * (student - p), N = rows with a visible key.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/kl_loss.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

struct DenseIndexerLseParams {
  float scale = 1.0f;  // indexer score scale
  std::int64_t cmp_ratio = 1;
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens_q;
  CuSeqlens cu_seqlens_k;
  int num_threads = 0;
};

// index_query [T, Hi, Di] | [B, Sq, Hi, Di]; index_key [S', Di] / [S', 1, Di] |
// [B, Sk', Di] / [B, Sk', 1, Di]; head_weights [T, Hi] | [B, Sq, Hi];
// indexer_lse [T] | [B, Sq] fp32, written (+inf on empty and padding rows).
void dense_indexer_lse(const TensorView& index_query, const TensorView& index_key,
                       const TensorView& head_weights, const DenseIndexerLseParams& params,
                       const TensorView& indexer_lse, Backend backend = Backend::automatic);

struct DenseIndexerKlParams {
  float scale = 1.0f;        // main attention logit scale
  float index_scale = 1.0f;  // indexer score scale
  float loss_coefficient = 1.0f;
  Reduction reduction = Reduction::mean;
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens_q;
  CuSeqlens cu_seqlens_k;
  int num_threads = 0;
};

// Inputs of both directions: the indexer tensors as in dense_indexer_lse;
// query [T, H, D] | [B, Sq, H, D]; key [S, Hk, D] (or [S, D] for Hk = 1) |
// [B, Sk, Hk, D] / [B, Sk, D], H % Hk == 0; query_rope / key_rope optional with
// the heads of query / key; softmax_max, softmax_sum [T, H] | [B, Sq, H] fp32;
// indexer_lse [T] | [B, Sq] fp32 (dense_indexer_lse's).
struct DenseIndexerKlInputs {
  TensorView index_query, index_key, head_weights, query, key, softmax_max, softmax_sum, indexer_lse, query_rope,
      key_rope;
};

// loss: one fp32 element, written.
void dense_indexer_kl_loss_fwd(const DenseIndexerKlInputs& inputs, const DenseIndexerKlParams& params,
                               const TensorView& loss, Backend backend = Backend::automatic);

// Gradients of grad_loss * loss w.r.t. index_query, index_key, head_weights
// (shapes and dtypes of the inputs, contiguous, overwritten). The teacher and
// the student are recomputed block by block.
struct DenseIndexerKlGrads {
  TensorView d_index_query, d_index_key, d_head_weights;
};

void dense_indexer_kl_loss_bwd(const DenseIndexerKlInputs& inputs, float grad_loss,
                               const DenseIndexerKlParams& params, const DenseIndexerKlGrads& grads,
                               Backend backend = Backend::automatic);

}  // namespace dsa
