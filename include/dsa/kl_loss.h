// Sparse indexer KL loss (docs/ops.md 4.3): trains the lightning indexer to
// imitate the main attention on the indexer's own selection.
//
//   teacher  P_h(t, i) = exp(scale * q_h . kv[idx_i] - max_h) / (sum_h [+ exp(sink_h - max_h)])
//            p = sum_h P_h, L1-normalised over the valid entries of the row
//   student  softmax over the same entries of I[t, idx_i] (4.1, with index_scale)
//   KL_t     = sum_i p (log p - log student)           (p = 0 terms contribute 0)
//   loss     = loss_coefficient * sum_t KL_t [/ N]      N = rows with a valid entry
//
// Only index_query, index_key and weights receive gradients:
//   dI = grad_loss * coefficient [/ N] * (student - p).
// The forward writes that per-entry factor (without grad_loss) into
// `score_grad`, so the backward never recomputes the teacher.
#pragma once

#include <cstdint>

#include "dsa/backend.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

enum class Reduction : int { mean, sum };

Reduction parse_reduction(const char* name);  // "mean" | "sum"

struct KlLossParams {
  float scale = 1.0f;        // main attention logit scale
  float index_scale = 1.0f;  // indexer score scale
  std::int64_t cmp_ratio = 1;  // > 1: kv, index_key and indices address compressed entries
  float loss_coefficient = 1.0f;
  Reduction reduction = Reduction::mean;
  Layout layout = Layout::TND;
  CuSeqlens cu_seqlens_q;
  CuSeqlens cu_seqlens_k;  // raw key lengths (see dsa/layout.h)
  int num_threads = 0;
};

// Inputs of both directions (the backward reads indices and the indexer side
// only). Shapes (TND | BSND); bf16, fp16 or fp32 unless noted; absent views
// are optional:
//   query        [T, H, D]              | [B, Sq, H, D]
//   kv           [S', D] / [S', 1, D]   | [B, Sk', D] / [B, Sk', 1, D], dtype of query
//   indices      [T, K] / [T, 1, K]     | [B, Sq, K] / [B, Sq, 1, K]    int32,
//                each in [-1, the sequence's keys) or an invalid_argument error
//   softmax_max, softmax_sum [T, H]     | [B, Sq, H]                   fp32
//   index_query  [T, Hi, Di]            | [B, Sq, Hi, Di]
//   index_key    [S', Di] / [S', 1, Di] | [B, Sk', Di] / ...           dtype of index_query
//   weights      [T, Hi]                | [B, Sq, Hi]
//   sinks        [H] fp32, optional; query_rope [.., H, Dr] / key_rope [S', Dr], optional
struct KlLossInputs {
  TensorView query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, sinks, query_rope,
      key_rope;
};

// Outputs (written): loss, one fp32 element; score_grad, shaped like indices
// (without the head dim), fp32, may be absent.
void kl_loss_fwd(const KlLossInputs& inputs, const KlLossParams& params, const TensorView& loss,
                 const TensorView& score_grad = TensorView{}, Backend backend = Backend::automatic);

// Gradients of grad_loss * loss w.r.t. the indexer inputs, from the forward's
// score_grad: shapes and dtypes of their inputs (contiguous), overwritten;
// rows and keys that take part in no valid entry get 0.
struct KlLossGrads {
  TensorView d_index_query, d_index_key, d_weights;
};

void kl_loss_bwd(const KlLossInputs& inputs, const TensorView& score_grad, float grad_loss,
                 const KlLossParams& params, const KlLossGrads& grads, Backend backend = Backend::automatic);

}  // namespace dsa
