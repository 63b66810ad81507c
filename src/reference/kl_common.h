// Shared pieces of the reference KL losses (docs/ops.md 4.3, 4.4): one (query,
// key) pair at a time, in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/numeric.h"
#include "ops/kl_loss.h"

namespace dsa::reference::kl {

// scale * (q[row, h] . k[key, key_head]) over the main and the rope dims.
inline double attention_logit(const HeadMatrix& q, const HeadMatrix& q_rope, const HeadMatrix& k,
                              const HeadMatrix& k_rope, std::int64_t row, std::int64_t h,
                              std::int64_t key, std::int64_t key_head, double scale) {
  double dot = 0.0;
  for (std::int64_t d = 0; d < q.dim; ++d) dot += static_cast<double>(q.at(row, h, d)) * k.at(key, key_head, d);
  if (q_rope.present())
    for (std::int64_t d = 0; d < q_rope.dim; ++d)
      dot += static_cast<double>(q_rope.at(row, h, d)) * k_rope.at(key, key_head, d);
  return scale * dot;
}

// Probability of the main attention's head `h` on a key with logit `logit`,
// normalised by the forward statistics (plus the sink). Heads whose row was
// empty in the forward (max = -inf or sum = 0) contribute nothing.
inline double head_probability(double logit, float max, float sum, const float* sink) {
  // (A NaN max or sum is no empty row: its NaN reaches the probability.)
  if (max == -INFINITY || sum <= 0.0f) return 0.0;
  double denominator = sum;
  if (sink) denominator += std::exp(static_cast<double>(*sink) - max);
  return std::exp(logit - max) / denominator;
}

using core::relu;  // keeps NaN, as torch.relu and the lightning indexer do

// I[row, key] = index_scale * sum_j w[row, j] * relu(iq[row, j] . ik[key]).
inline double indexer_score(const HeadMatrix& iq, const HeadMatrix& ik, const HeadMatrix& w,
                            std::int64_t row, std::int64_t key, double index_scale) {
  double score = 0.0;
  for (std::int64_t j = 0; j < iq.heads; ++j) {
    double dot = 0.0;
    for (std::int64_t d = 0; d < iq.dim; ++d) dot += static_cast<double>(iq.at(row, j, d)) * ik.at(key, 0, d);
    score += static_cast<double>(w.at(row, j, 0)) * relu(dot);
  }
  return index_scale * score;
}

// Gradient accumulators of the indexer inputs, in double.
struct IndexerGrads {
  std::vector<double> dq, dk, dw;
  IndexerGrads(const HeadMatrix& iq, std::int64_t rows, std::int64_t key_rows)
      : dq(rows * iq.heads * iq.dim), dk(key_rows * iq.dim), dw(rows * iq.heads) {}

  // Back-propagates dI = g at (row, key) through the ReLU and the weighted head sum.
  void add(const HeadMatrix& iq, const HeadMatrix& ik, const HeadMatrix& w, std::int64_t row,
           std::int64_t key, double g, double index_scale) {
    const std::int64_t heads = iq.heads, dim = iq.dim;
    for (std::int64_t j = 0; j < heads; ++j) {
      double dot = 0.0;
      for (std::int64_t d = 0; d < dim; ++d) dot += static_cast<double>(iq.at(row, j, d)) * ik.at(key, 0, d);
      dw[row * heads + j] += g * index_scale * relu(dot);
      // The ReLU's gate passes g where dot > 0. Where it is closed the terms
      // are 0 times the inputs: exactly 0 when dot is finite (then every input
      // is), so they are skipped; a NaN or infinite dot keeps them, and their
      // 0 * NaN, as the fused kernels' products and autograd do.
      if (dot > 0.0 || !std::isfinite(dot)) {
        const double c = dot > 0.0 ? g * index_scale * w.at(row, j, 0) : 0.0;
        for (std::int64_t d = 0; d < dim; ++d) {
          dq[(row * heads + j) * dim + d] += c * ik.at(key, 0, d);
          dk[key * dim + d] += c * iq.at(row, j, d);
        }
      }
    }
  }

  void store(DType q_dtype, DType w_dtype, void* d_query, void* d_key, void* d_weights) const {
    for (std::size_t i = 0; i < dq.size(); ++i) core::store_float(d_query, q_dtype, i, static_cast<float>(dq[i]));
    for (std::size_t i = 0; i < dk.size(); ++i) core::store_float(d_key, q_dtype, i, static_cast<float>(dk[i]));
    for (std::size_t i = 0; i < dw.size(); ++i) core::store_float(d_weights, w_dtype, i, static_cast<float>(dw[i]));
  }
};

}  // namespace dsa::reference::kl
