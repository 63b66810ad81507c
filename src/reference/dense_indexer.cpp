// Reference dense warm-up ops: docs/ops.md 4.4, literally, one (query, key) pair at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include "reference/kl_common.h"

namespace dsa::reference {

void dense_indexer_lse(const DenseLseProblem& p) {
  std::fill(p.lse, p.lse + p.plan.q_rows, core::kPosInf);
  std::vector<double> score;
  for (const auto& seq : p.plan.seqs) {
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      const std::int64_t row = seq.q_begin + i;
      const std::int64_t visible = visible_compressed(seq.position(i), p.ratio);
      if (visible <= 0) continue;
      score.resize(visible);
      double max_score = -INFINITY;
      for (std::int64_t s = 0; s < visible; ++s) {
        score[s] = kl::indexer_score(p.index_query, p.index_key, p.weights, row, seq.c_begin + s, p.scale);
        max_score = std::max(max_score, score[s]);
      }
      double z = 0.0;
      for (double v : score) z += std::exp(v - max_score);
      p.lse[row] = static_cast<float>(max_score + std::log(z));
    }
  }
}

namespace {

// Teacher p(t, s) = sum_h softmax_h(t, s) / H.
double dense_teacher(const DenseKlProblem& p, std::int64_t row, std::int64_t key) {
  const std::int64_t heads = p.query.heads, group = p.group();
  double sum = 0.0;
  for (std::int64_t h = 0; h < heads; ++h) {
    const double logit = kl::attention_logit(p.query, p.query_rope, p.key, p.key_rope, row, h, key, h / group, p.scale);
    sum += kl::head_probability(logit, p.softmax_max[row * heads + h], p.softmax_sum[row * heads + h], nullptr);
  }
  return sum / static_cast<double>(heads);
}

// Rows in the loss: a visible key and an indexer_lse that is not infinite (an
// lse of +inf marks an empty row; a NaN one is counted, so its NaN reaches the loss).
bool counted_row(const DenseKlProblem& p, const core::SequenceSlice& seq, std::int64_t i) {
  return seq.position(i) >= 0 && !std::isinf(p.lse[seq.q_begin + i]);
}

std::int64_t counted_rows(const DenseKlProblem& p) {
  std::int64_t n = 0;
  for (const auto& seq : p.plan.seqs)
    for (std::int64_t i = 0; i < seq.q_len; ++i) n += counted_row(p, seq, i);
  return n;
}

// fn(row, key) for every causal (query row, key row) pair of the counted rows.
template <class Fn>
void for_each_counted_pair(const DenseKlProblem& p, Fn&& fn) {
  for (const auto& seq : p.plan.seqs)
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      if (!counted_row(p, seq, i)) continue;
      for (std::int64_t s = 0; s <= seq.position(i); ++s) fn(seq.q_begin + i, seq.k_begin + s);
    }
}

}  // namespace

void dense_indexer_kl_loss_fwd(const DenseKlProblem& p) {
  double total = 0.0;
  for_each_counted_pair(p, [&](std::int64_t row, std::int64_t key) {
    const double teacher = dense_teacher(p, row, key);
    if (teacher <= 0.0) return;  // 0 log 0 = 0; a NaN teacher is added
    const double log_student =
        kl::indexer_score(p.index_query, p.index_key, p.weights, row, key, p.index_scale) - p.lse[row];
    total += teacher * (std::log(teacher) - log_student);
  });
  *p.loss = static_cast<float>(reduction_factor(p.reduction, p.coefficient, counted_rows(p)) * total);
}

void dense_indexer_kl_loss_bwd(const DenseKlProblem& p) {
  const double factor = p.grad_loss * reduction_factor(p.reduction, p.coefficient, counted_rows(p));
  kl::IndexerGrads grads(p.index_query, p.plan.q_rows, p.key_rows);
  for_each_counted_pair(p, [&](std::int64_t row, std::int64_t key) {
    const double student =
        std::exp(kl::indexer_score(p.index_query, p.index_key, p.weights, row, key, p.index_scale) - p.lse[row]);
    const double g = factor * (student - dense_teacher(p, row, key));
    grads.add(p.index_query, p.index_key, p.weights, row, key, g, p.index_scale);
  });
  grads.store(p.index_query.dtype, p.weights.dtype, p.d_index_query, p.d_index_key, p.d_weights);
}

}  // namespace dsa::reference
