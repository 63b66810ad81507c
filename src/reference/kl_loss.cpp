// Reference sparse indexer KL loss: docs/ops.md 4.3, literally, one row at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include "reference/kl_common.h"

namespace dsa::reference {

void kl_loss_fwd(const SparseKlProblem& p) {
  const std::int64_t heads = p.query.heads;
  if (p.score_grad) std::fill(p.score_grad, p.score_grad + p.plan.q_rows * p.topk, 0.0f);
  double total = 0.0;
  std::int64_t counted = 0;
  std::vector<std::int64_t> slots;
  std::vector<double> teacher, score;
  for (const auto& seq : p.plan.seqs) {
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      const std::int64_t row = seq.q_begin + i;
      slots.clear();
      for (std::int64_t k = 0; k < p.topk; ++k)
        if (p.valid(seq, i, p.indices[row * p.index_row_stride + k])) slots.push_back(k);
      if (slots.empty()) continue;
      ++counted;
      teacher.assign(slots.size(), 0.0);
      score.assign(slots.size(), 0.0);
      double mass = 0.0, max_score = -INFINITY;
      for (std::size_t e = 0; e < slots.size(); ++e) {
        const std::int64_t key = seq.c_begin + p.indices[row * p.index_row_stride + slots[e]];
        for (std::int64_t h = 0; h < heads; ++h) {
          const double logit = kl::attention_logit(p.query, p.query_rope, p.kv, p.key_rope, row, h, key, 0, p.scale);
          teacher[e] += kl::head_probability(logit, p.softmax_max[row * heads + h], p.softmax_sum[row * heads + h],
                                             p.sinks ? p.sinks + h : nullptr);
        }
        mass += teacher[e];
        score[e] = kl::indexer_score(p.index_query, p.index_key, p.weights, row, key, p.index_scale);
        max_score = std::max(max_score, score[e]);
      }
      // A row whose teacher has no mass has KL 0 and gradient 0 (d/dI of sum_i p_i (..) is (sum p) s - p).
      if (mass <= 0.0) continue;  // (a NaN mass is counted: its NaN reaches the loss)
      double z = 0.0;
      for (double s : score) z += std::exp(s - max_score);
      const double lse = max_score + std::log(z);
      for (std::size_t e = 0; e < slots.size(); ++e) {
        const double pe = teacher[e] / mass;
        const double log_student = score[e] - lse;
        if (pe != 0.0) total += pe * (std::log(pe) - log_student);  // 0 log 0 = 0; NaN is added
        if (p.score_grad) p.score_grad[row * p.topk + slots[e]] = static_cast<float>(std::exp(log_student) - pe);
      }
    }
  }
  const double factor = reduction_factor(p.reduction, p.coefficient, counted);
  *p.loss = static_cast<float>(factor * total);
  if (p.score_grad)
    for (std::int64_t n = 0; n < p.plan.q_rows * p.topk; ++n)
      p.score_grad[n] = static_cast<float>(factor * p.score_grad[n]);
}

void kl_loss_bwd(const SparseKlBackwardProblem& p) {
  kl::IndexerGrads grads(p.index_query, p.plan.q_rows, p.key_rows);
  for (const auto& seq : p.plan.seqs) {
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      const std::int64_t row = seq.q_begin + i;
      for (std::int64_t k = 0; k < p.topk; ++k) {
        const std::int32_t idx = p.indices[row * p.index_row_stride + k];
        if (!p.valid(seq, i, idx)) continue;
        const double g = static_cast<double>(p.grad_loss) * p.score_grad[row * p.topk + k];
        grads.add(p.index_query, p.index_key, p.weights, row, seq.c_begin + idx, g, p.index_scale);
      }
    }
  }
  grads.store(p.index_query.dtype, p.weights.dtype, p.d_index_query, p.d_index_key, p.d_weights);
}

}  // namespace dsa::reference
