// The row bookkeeping both families of sparse KL kernels share (the generic
// ones and the bf16 pair ones): which query rows there are, which of a row's
// top-k entries take part, and the loss's reduction. Plain C++, but compiled
// into files built for different ISAs, so everything has internal linkage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/kl_loss.h"

namespace dsa::cpu::kl_kernels {
namespace {

struct RowRef {
  std::int64_t seq, i;
};

std::vector<RowRef> sequence_rows(const core::SequencePlan& plan) {
  std::vector<RowRef> rows;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(plan.seqs.size()); ++b)
    for (std::int64_t i = 0; i < plan.seqs[b].q_len; ++i) rows.push_back({b, i});
  return rows;
}

// Forward: the row's valid entries in top-k order, each as its slot k and its
// key row; returns how many.
std::int64_t valid_entries(const SparseKlProblem& p, const core::SequenceSlice& seq, std::int64_t i,
                           std::int64_t* slots, std::int64_t* key_rows) {
  const std::int32_t* idx = p.indices + (seq.q_begin + i) * p.index_row_stride;
  std::int64_t n = 0;
  for (std::int64_t k = 0; k < p.topk; ++k)
    if (p.valid(seq, i, idx[k])) {
      slots[n] = k;
      key_rows[n++] = seq.c_begin + idx[k];
    }
  return n;
}

// Backward: the row's valid entries whose score gradient is not 0, each as
// that gradient (times grad_loss) and its key row; returns how many.
std::int64_t gradient_entries(const SparseKlBackwardProblem& p, const core::SequenceSlice& seq, std::int64_t i,
                              float* g, std::int64_t* key_rows) {
  const std::int64_t row = seq.q_begin + i;
  const std::int32_t* idx = p.indices + row * p.index_row_stride;
  std::int64_t n = 0;
  for (std::int64_t k = 0; k < p.topk; ++k) {
    const float gk = p.grad_loss * p.score_grad[row * p.topk + k];
    if (gk != 0.0f && p.valid(seq, i, idx[k])) {
      g[n] = gk;
      key_rows[n++] = seq.c_begin + idx[k];
    }
  }
  return n;
}

// The loss from every row's KL, added in row order (the same bits for any
// thread count), and the reduction's factor applied to the saved score gradient.
void finish_sparse_loss(const SparseKlProblem& p, const std::vector<char>& counted, const std::vector<double>& row_kl) {
  std::int64_t n_counted = 0;
  double total = 0.0;
  for (std::int64_t r = 0; r < p.plan.q_rows; ++r) {
    n_counted += counted[r];
    total += row_kl[r];
  }
  const double factor = reduction_factor(p.reduction, p.coefficient, n_counted);
  *p.loss = static_cast<float>(factor * total);
  if (p.score_grad) {
    const float f = static_cast<float>(factor);
    for (std::int64_t k = 0; k < p.plan.q_rows * p.topk; ++k) p.score_grad[k] *= f;
  }
}

}  // namespace
}  // namespace dsa::cpu::kl_kernels
