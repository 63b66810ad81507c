// Reference sparse attention: docs/ops.md 4.2, literally, one query and head at
// a time, in double precision. The oracle of the fused backends.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/numeric.h"
#include "ops/sparse_attention.h"

namespace dsa::reference {
namespace {

using core::load_float;
using core::store_float;

// One attended key: a row of kv (raw) or of cmp_kv (compressed).
struct Entry {
  bool compressed;
  std::int64_t row;  // row of the packed / flattened key tensor
};

// The attended set of query i of `seq`, in order: raw part, then compressed part.
std::vector<Entry> attended(const SparseAttentionProblem& p, const core::SequenceSlice& seq,
                            std::int64_t i) {
  std::vector<Entry> set;
  const std::int64_t row = seq.q_begin + i;
  const auto w = p.row_window(seq, i);
  if (p.indices) {
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const std::int64_t j = p.indices[row * p.idx_row_stride + k];
      if (j < 0 || j >= seq.k_len || j > w.pos) continue;  // invalid or not visible: skipped
      set.push_back({false, seq.k_begin + j});
    }
  } else {
    for (std::int64_t j = w.raw_lo; j <= w.pos; ++j) set.push_back({false, seq.k_begin + j});
  }
  if (p.cmp_kv) {
    if (p.cmp_indices) {
      for (std::int64_t k = 0; k < p.cmp_topk; ++k) {
        const std::int64_t c = p.cmp_indices[row * p.cidx_row_stride + k];
        if (c < 0 || c >= seq.c_len || c >= w.cmp_visible) continue;
        set.push_back({true, seq.c_begin + c});
      }
    } else {
      for (std::int64_t c = 0; c < w.cmp_visible; ++c) set.push_back({true, seq.c_begin + c});
    }
  }
  return set;
}

// fn(row, set) for every query row with a nonempty attended set.
template <class Fn>
void for_each_attending_row(const SparseAttentionProblem& p, Fn&& fn) {
  for (const auto& seq : p.plan.seqs)
    for (std::int64_t i = 0; i < seq.q_len; ++i) {
      const std::vector<Entry> set = attended(p, seq, i);
      if (!set.empty()) fn(seq.q_begin + i, set);
    }
}

double key_element(const SparseAttentionProblem& p, const Entry& e, std::int64_t d) {
  if (d < p.dim) {
    return e.compressed ? load_float(p.cmp_kv, p.dtype, e.row * p.cmp_row_stride + d)
                        : load_float(p.kv, p.dtype, e.row * p.kv_row_stride + d);
  }
  return load_float(p.key_rope, p.dtype, e.row * p.kr_row_stride + (d - p.dim));
}

double query_element(const SparseAttentionProblem& p, std::int64_t row, std::int64_t h, std::int64_t d) {
  if (d < p.dim) return load_float(p.query, p.dtype, row * p.q_row_stride + h * p.q_head_stride + d);
  return load_float(p.query_rope, p.dtype, row * p.qr_row_stride + h * p.qr_head_stride + (d - p.dim));
}

double logit(const SparseAttentionProblem& p, std::int64_t row, std::int64_t h, const Entry& e) {
  double dot = 0.0;
  for (std::int64_t d = 0; d < p.qk_dim(); ++d) dot += query_element(p, row, h, d) * key_element(p, e, d);
  return static_cast<double>(p.scale) * dot;
}

// Normaliser terms relative to max(m, sink), which stay finite for any sink:
// returns {exp(m - top), exp(sink - top) or 0, top}.
struct Normaliser {
  double scale_m, sink_term;
};
Normaliser normaliser(const SparseAttentionProblem& p, std::int64_t h, double m) {
  if (!p.sinks) return {1.0, 0.0};
  const double sink = p.sinks[h];
  const double top = std::max(m, sink);
  if (std::isinf(top) && top < 0) return {1.0, 0.0};  // sink -inf and m -inf: no sink term
  if (sink == INFINITY && m < sink) return {0.0, 1.0};  // a +inf sink takes all the mass
  return {std::exp(m - top), std::exp(sink - top)};
}

}  // namespace

void sparse_attention_fwd(const SparseAttentionProblem& p) {
  const std::int64_t H = p.heads, dv = p.d_v;
  for (std::int64_t r = 0; r < p.plan.q_rows; ++r)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t d = 0; d < dv; ++d) store_float(p.out, p.dtype, (r * H + h) * dv + d, 0.0f);
      p.softmax_max[r * H + h] = core::kNegInf;
      p.softmax_sum[r * H + h] = 0.0f;
    }
  // Per-row scratch only when there are rows: without them H and d_v are
  // bounded by no memory (a [0, 2^40, 1] query is legal; found by fuzz_sparse_attention).
  std::vector<double> logits, acc(p.plan.q_rows ? dv : 0);
  for_each_attending_row(p, [&](std::int64_t row, const std::vector<Entry>& set) {
    for (std::int64_t h = 0; h < H; ++h) {
      logits.clear();
      double m = -std::numeric_limits<double>::infinity();
      for (const Entry& e : set) {
        logits.push_back(logit(p, row, h, e));
        m = std::max(m, logits.back());
      }
      double sum = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::size_t k = 0; k < set.size(); ++k) {
        const double w = std::exp(logits[k] - m);
        sum += w;
        for (std::int64_t d = 0; d < dv; ++d) acc[d] += w * key_element(p, set[k], d);
      }
      const Normaliser n = normaliser(p, h, m);
      const double denom = sum * n.scale_m + n.sink_term;
      for (std::int64_t d = 0; d < dv; ++d)
        store_float(p.out, p.dtype, (row * H + h) * dv + d, static_cast<float>(acc[d] * n.scale_m / denom));
      p.softmax_max[row * H + h] = static_cast<float>(m);
      p.softmax_sum[row * H + h] = static_cast<float>(sum);
    }
  });
}

void sparse_attention_bwd(const SparseAttentionProblem& p) {
  const std::int64_t H = p.heads, D = p.dim, Dr = p.rope_dim, Dqk = p.qk_dim(), dv = p.d_v;
  std::vector<double> d_query(p.plan.q_rows * H * Dqk, 0.0);
  std::vector<double> d_kv(p.kv_rows * Dqk, 0.0);  // rope dims live at [D, Dqk)
  std::vector<double> d_cmp(p.cmp_rows * D, 0.0);
  // As in the forward: nothing sized from H or d_v alone unless rows (or sinks) exist.
  std::vector<double> d_sinks(p.d_sinks ? H : 0, 0.0);
  std::vector<double> grad(p.plan.q_rows ? dv : 0);

  for_each_attending_row(p, [&](std::int64_t row, const std::vector<Entry>& set) {
    for (std::int64_t h = 0; h < H; ++h) {
      const double m = p.saved_max[row * H + h], sum = p.saved_sum[row * H + h];
      if (std::isinf(m) && m < 0) continue;
      const Normaliser n = normaliser(p, h, m);
      const double denom = sum * n.scale_m + n.sink_term;
      // delta = dO . out = sum_j P_j (dO . v_j): the softmax backward's row term.
      double delta = 0.0;
      for (std::int64_t d = 0; d < dv; ++d) {
        grad[d] = load_float(p.grad_out, p.dtype, row * p.go_row_stride + h * p.go_head_stride + d);
        delta += grad[d] * load_float(p.fwd_out, p.dtype, row * p.o_row_stride + h * p.o_head_stride + d);
      }
      for (const Entry& e : set) {
        const double prob = std::exp(logit(p, row, h, e) - m) * n.scale_m / denom;
        double dprob = 0.0;
        for (std::int64_t d = 0; d < dv; ++d) dprob += grad[d] * key_element(p, e, d);
        const double dlogit = prob * (dprob - delta) * p.scale;
        double* dk = e.compressed ? &d_cmp[e.row * D] : &d_kv[e.row * Dqk];
        for (std::int64_t d = 0; d < Dqk; ++d) {
          d_query[(row * H + h) * Dqk + d] += dlogit * key_element(p, e, d);
          dk[d] += dlogit * query_element(p, row, h, d);
        }
        for (std::int64_t d = 0; d < dv; ++d) dk[d] += prob * grad[d];  // the value contribution
      }
      if (p.sinks) d_sinks[h] -= n.sink_term / denom * delta;
    }
  });

  for (std::int64_t r = 0; r < p.plan.q_rows; ++r)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t d = 0; d < D; ++d)
        store_float(p.d_query, p.dtype, (r * H + h) * D + d, static_cast<float>(d_query[(r * H + h) * Dqk + d]));
      for (std::int64_t d = 0; d < Dr; ++d)
        store_float(p.d_query_rope, p.dtype, (r * H + h) * Dr + d,
                    static_cast<float>(d_query[(r * H + h) * Dqk + D + d]));
    }
  for (std::int64_t j = 0; j < p.kv_rows; ++j) {
    for (std::int64_t d = 0; d < D; ++d) store_float(p.d_kv, p.dtype, j * D + d, static_cast<float>(d_kv[j * Dqk + d]));
    for (std::int64_t d = 0; d < Dr; ++d)
      store_float(p.d_key_rope, p.dtype, j * Dr + d, static_cast<float>(d_kv[j * Dqk + D + d]));
  }
  for (std::int64_t c = 0; c < p.cmp_rows; ++c)
    for (std::int64_t d = 0; d < D; ++d) store_float(p.d_cmp_kv, p.dtype, c * D + d, static_cast<float>(d_cmp[c * D + d]));
  if (p.d_sinks)
    for (std::int64_t h = 0; h < H; ++h) p.d_sinks[h] = static_cast<float>(d_sinks[h]);
}

}  // namespace dsa::reference
