// The generic sparse KL kernels (spec 4.3): see kl_generic_common.h for who includes them.
#pragma once

#include "cpu/isa/kl_generic_common.h"
#include "cpu/kl_loss/kl_kernels.h"
#include "cpu/kl_loss/kl_sparse_rows.h"

namespace dsa::cpu::kl_kernels {
namespace {


void sparse_fwd(const SparseKlProblem& p) {
  const int64_t heads = p.query.heads, dq = p.query.dim + (p.query_rope.present() ? p.query_rope.dim : 0);
  const int64_t iheads = p.index_query.heads, idim = p.index_query.dim, topk = p.topk;
  const std::vector<RowRef> rows = sequence_rows(p.plan);
  std::vector<double> row_kl(p.plan.q_rows, 0.0);
  std::vector<char> counted(p.plan.q_rows, 0);
  if (p.score_grad) std::fill(p.score_grad, p.score_grad + p.plan.q_rows * topk, 0.0f);

  const int64_t n_tasks = (static_cast<int64_t>(rows.size()) + kSparseRows - 1) / kSparseRows;
  const int threads = thread_count(n_tasks, p.num_threads);
  struct Scratch {
    std::vector<float> qa, ia, w, inv_den, max, kt, ikt, row, logits, idots, teacher, score;
    std::vector<int64_t> slots, key_rows;
  };
  // Per-thread buffers only when there is a task: without query rows (or keys)
  // the head counts and dims are bounded by no memory (a [0, 2^40, 1] tensor is
  // legal; found by fuzz_dense_indexer), so nothing may be sized from them.
  std::vector<Scratch> scratch(n_tasks ? threads : 0);
  // The key tiles' dims are bounded (by kv / index_key) only where there are keys;
  // without any no entry is valid and no tile is packed.
  const bool any_keys = p.any_key_rows();
  const int64_t tile_dq = any_keys ? dq : 0, tile_idim = any_keys ? idim : 0;
  for (auto& s : scratch) {
    size_scratch(s.qa, heads * dq);
    size_scratch(s.ia, iheads * idim);
    size_scratch(s.w, iheads);
    size_scratch(s.inv_den, heads);
    size_scratch(s.max, heads);
    size_scratch(s.kt, tile_dq * kTile);
    size_scratch(s.ikt, tile_idim * kTile);
    size_scratch(s.row, kTile * std::max(tile_dq, tile_idim));
    size_scratch(s.logits, heads * kTile);
    size_scratch(s.idots, iheads * kTile);
    s.teacher.resize(topk + kTile);
    s.score.resize(topk + kTile);
    s.slots.resize(topk);
    s.key_rows.resize(topk + kTile);
  }

  core::parallel_for(n_tasks, threads, [&](int64_t task, int thread) {
    Scratch& s = scratch[thread];
    const int64_t end = std::min<int64_t>(rows.size(), (task + 1) * kSparseRows);
    for (int64_t r = task * kSparseRows; r < end; ++r) {
      const auto& seq = p.plan.seqs[rows[r].seq];
      const int64_t i = rows[r].i, row = seq.q_begin + i;
      const int64_t n = valid_entries(p, seq, i, s.slots.data(), s.key_rows.data());
      if (n == 0) continue;
      counted[row] = 1;
      pack_heads(p.query, p.query_rope, row, 0, heads, s.qa.data());
      pack_heads(p.index_query, HeadMatrix{}, row, 0, iheads, s.ia.data());
      for (int64_t j = 0; j < iheads; ++j) s.w[j] = p.index_scale * p.weights.at(row, j, 0);
      for (int64_t h = 0; h < heads; ++h) {
        s.max[h] = p.softmax_max[row * heads + h];
        s.inv_den[h] = inverse_denominator(s.max[h], p.softmax_sum[row * heads + h], p.sinks ? p.sinks + h : nullptr);
      }
      for (int64_t c0 = 0; c0 < n; c0 += kTile) {
        const int64_t m = std::min(kTile, n - c0);
        pack_key_tile(p.kv, p.key_rope, s.key_rows.data() + c0, m, 0, s.kt.data(), s.row.data());
        dots(s.qa.data(), heads, dq, s.kt.data(), s.logits.data());
        float teacher[kTile] = {};
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = s.inv_den[h], mx = s.max[h];
          if (inv == 0.0f) continue;
          const float* l = s.logits.data() + h * kTile;
          add_exp_tile(l, p.scale, mx, inv, teacher);
        }
        pack_key_tile(p.index_key, HeadMatrix{}, s.key_rows.data() + c0, m, 0, s.ikt.data(), s.row.data());
        dots(s.ia.data(), iheads, idim, s.ikt.data(), s.idots.data());
        float score[kTile] = {};
        for (int64_t j = 0; j < iheads; ++j) {
          const float wj = s.w[j];
          const float* dj = s.idots.data() + j * kTile;
          for (int64_t e = 0; e < kTile; ++e) score[e] += wj * relu(dj[e]);
        }
        std::memcpy(s.teacher.data() + c0, teacher, sizeof(float) * m);
        std::memcpy(s.score.data() + c0, score, sizeof(float) * m);
      }
      double mass = 0.0;
      float max_score = core::kNegInf;
      for (int64_t e = 0; e < n; ++e) {
        mass += s.teacher[e];
        max_score = std::max(max_score, s.score[e]);
      }
      // No teacher mass: KL 0 and gradient (sum p) * student - p = 0.
      if (mass <= 0.0) continue;  // (a NaN mass is counted: its NaN reaches the loss)
      double z = 0.0;
      for (int64_t e = 0; e < n; ++e) z += std::exp(static_cast<double>(s.score[e]) - max_score);
      const double lse = max_score + std::log(z);
      const double inv_mass = 1.0 / mass;
      double kl = 0.0;
      float* grad = p.score_grad ? p.score_grad + row * topk : nullptr;
      for (int64_t e = 0; e < n; ++e) {
        const double pe = s.teacher[e] * inv_mass, log_student = s.score[e] - lse;
        if (pe != 0.0) kl += pe * (std::log(pe) - log_student);  // 0 log 0 = 0; NaN is added
        if (grad) grad[s.slots[e]] = static_cast<float>(std::exp(log_student) - pe);
      }
      row_kl[row] = kl;
    }
  });

  finish_sparse_loss(p, counted, row_kl);
}

void sparse_bwd(const SparseKlBackwardProblem& p) {
  const int64_t iheads = p.index_query.heads, idim = p.index_query.dim, topk = p.topk;
  const DType qdt = p.index_query.dtype, wdt = p.weights.dtype;
  const std::vector<RowRef> rows = sequence_rows(p.plan);
  std::memset(p.d_index_query, 0, p.plan.q_rows * iheads * idim * dtype_size(qdt));
  std::memset(p.d_weights, 0, p.plan.q_rows * iheads * dtype_size(wdt));
  const float is = p.index_scale;

  // dQ and dW: every task owns its rows. Per 32-entry tile: the dots (a GEMM
  // against the transposed tile), then dQ += coef . K as a second GEMM.
  {
    const int64_t n_tasks = (static_cast<int64_t>(rows.size()) + kSparseRows - 1) / kSparseRows;
    const int threads = thread_count(n_tasks, p.num_threads);
    struct Scratch {
      std::vector<float> ia, w, ikt, krows, idots, coef, dq, dw, g;
      std::vector<int64_t> key_rows;
      std::vector<const float*> arow;
      std::vector<float*> crow;
    };
    std::vector<Scratch> scratch(n_tasks ? threads : 0);  // as in sparse_fwd: none without tasks
    for (auto& s : scratch) {
      size_scratch(s.ia, iheads * idim);
      size_scratch(s.w, iheads);
      size_scratch(s.ikt, (p.any_key_rows() ? idim : 0) * kTile);  // as in sparse_fwd
      size_scratch(s.krows, kTile * (p.any_key_rows() ? idim : 0));
      size_scratch(s.idots, iheads * kTile);
      size_scratch(s.coef, iheads * kTile);
      size_scratch(s.dq, iheads * idim);
      size_scratch(s.dw, iheads);
      s.g.resize(topk + kTile);
      s.key_rows.resize(topk + kTile);
      s.arow.resize(std::max<int64_t>(iheads, 1));
      s.crow.resize(std::max<int64_t>(iheads, 1));
      for (int64_t j = 0; j < iheads; ++j) {
        s.arow[j] = s.coef.data() + j * kTile;
        s.crow[j] = s.dq.data() + j * idim;
      }
    }
    core::parallel_for(n_tasks, threads, [&](int64_t task, int thread) {
      Scratch& s = scratch[thread];
      const int64_t end = std::min<int64_t>(rows.size(), (task + 1) * kSparseRows);
      for (int64_t r = task * kSparseRows; r < end; ++r) {
        const auto& seq = p.plan.seqs[rows[r].seq];
        const int64_t i = rows[r].i, row = seq.q_begin + i;
        const int64_t n = gradient_entries(p, seq, i, s.g.data(), s.key_rows.data());
        if (n == 0) continue;
        pack_heads(p.index_query, HeadMatrix{}, row, 0, iheads, s.ia.data());
        for (int64_t j = 0; j < iheads; ++j) s.w[j] = p.weights.at(row, j, 0);
        std::fill(s.dq.begin(), s.dq.end(), 0.0f);
        std::fill(s.dw.begin(), s.dw.end(), 0.0f);
        for (int64_t c0 = 0; c0 < n; c0 += kTile) {
          const int64_t m = std::min(kTile, n - c0);
          pack_key_tile(p.index_key, HeadMatrix{}, s.key_rows.data() + c0, m, 0, s.ikt.data(), s.krows.data());
          dots(s.ia.data(), iheads, idim, s.ikt.data(), s.idots.data());
          float g[kTile] = {};
          std::memcpy(g, s.g.data() + c0, sizeof(float) * m);
          for (int64_t j = 0; j < iheads; ++j) {
            s.dw[j] += gate_tile(s.idots.data() + j * kTile, g, s.w[j] * is, s.coef.data() + j * kTile) * is;
          }
          // dQ[j] += sum_e coef[j][e] * K[e], entries in order (the tile's zero rows past m are skipped).
          mm(iheads, idim, m, s.arow.data(), 1, s.krows.data(), idim, s.crow.data(), true);
        }
        from_f32(s.dq.data(), qdt, iheads * idim,
                 static_cast<char*>(p.d_index_query) + row * iheads * idim * dtype_size(qdt));
        from_f32(s.dw.data(), wdt, iheads, static_cast<char*>(p.d_weights) + row * iheads * dtype_size(wdt));
      }
    });
  }

  // dK: tasks own kKeyTask consecutive key rows. Each task's entries are listed
  // in row order (within a row, in the row's entry order), so a task walks the
  // rows that selected any of its keys; per such row the dots of all its
  // selected keys with all Hi heads are one GEMM (the same chains as the
  // forward's, so the same ReLU gate) and dK += coef . Q[row] another. Every
  // dK element sums rows in row order, heads in order: the same bits for any
  // thread count.
  const int64_t n_tasks = (p.key_rows + kKeyTask - 1) / kKeyTask;
  std::vector<int64_t> start(n_tasks + 1, 0);
  for (const auto& rr : rows) {
    const auto& seq = p.plan.seqs[rr.seq];
    const int64_t row = seq.q_begin + rr.i;
    const std::int32_t* idx = p.indices + row * p.index_row_stride;
    for (int64_t k = 0; k < topk; ++k)
      if (p.score_grad[row * topk + k] != 0.0f && p.valid(seq, rr.i, idx[k]))
        ++start[(seq.c_begin + idx[k]) / kKeyTask + 1];
  }
  for (int64_t t = 0; t < n_tasks; ++t) start[t + 1] += start[t];
  // entries[e] = row * topk + k (its key: c_begin of the row's sequence + indices[row][k]).
  std::vector<int64_t> entries(start[n_tasks]);
  std::vector<std::int32_t> seq_of_row(start[n_tasks] > 0 ? p.plan.q_rows : 0);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (const auto& rr : rows) {
      const auto& seq = p.plan.seqs[rr.seq];
      const int64_t row = seq.q_begin + rr.i;
      const std::int32_t* idx = p.indices + row * p.index_row_stride;
      for (int64_t k = 0; k < topk; ++k)
        if (p.score_grad[row * topk + k] != 0.0f && p.valid(seq, rr.i, idx[k])) {
          entries[fill[(seq.c_begin + idx[k]) / kKeyTask]++] = row * topk + k;
          seq_of_row[row] = static_cast<std::int32_t>(rr.seq);
        }
    }
  }
  const auto entry_key = [&](int64_t e) {
    const int64_t row = entries[e] / topk, k = entries[e] - row * topk;
    return p.plan.seqs[seq_of_row[row]].c_begin + p.indices[row * p.index_row_stride + k];
  };
  // The dK pass visits each query row once per task that it selected keys of:
  // convert the index queries to fp32 once (input-sized, O(T * Hi * Di)).
  std::vector<float> iq32;
  const float* iq_rows = nullptr;
  if (qdt == DType::f32 && p.index_query.head_stride == idim && p.index_query.row_stride == iheads * idim) {
    iq_rows = static_cast<const float*>(p.index_query.data);
  } else if (start[n_tasks] > 0) {
    iq32.resize(p.plan.q_rows * iheads * idim);
    const int64_t n_rows = p.plan.q_rows;
    core::parallel_for(n_rows, thread_count(std::max<int64_t>(n_rows, 1), p.num_threads), [&](int64_t row, int) {
      pack_heads(p.index_query, HeadMatrix{}, row, 0, iheads, iq32.data() + row * iheads * idim);
    });
    iq_rows = iq32.data();
  }
  const int threads = thread_count(std::max<int64_t>(n_tasks, 1), p.num_threads);
  struct Scratch {
    std::vector<float> keys, acc, qt, w, d, coef;
    std::vector<int64_t> stamp;
    std::vector<const float*> arow;
    std::vector<float*> crow;
    std::vector<int64_t> local;
    std::vector<float> g;
  };
  std::vector<Scratch> scratch(n_tasks ? threads : 0);  // as in sparse_fwd: none without tasks
  // A task has key rows, so index_key bounds idim; iheads is bounded (by weights) only
  // where some query row exists, and only rows that selected a key use those buffers:
  // without one, sized from iheads they could be any size ([0, 2^40] weights address
  // nothing; found by fuzz_kl_loss, corpus regression-empty-query-huge-index-heads-*).
  const int64_t per_row_heads = start[n_tasks] > 0 ? iheads : 0;
  for (auto& s : scratch) {
    size_scratch(s.keys, kKeyTask * idim);
    size_scratch(s.acc, kKeyTask * idim);
    size_scratch(s.qt, idim * per_row_heads);
    size_scratch(s.w, per_row_heads);
    size_scratch(s.d, kKeyTask * per_row_heads);
    size_scratch(s.coef, kKeyTask * per_row_heads);
    s.stamp.resize(kKeyTask);
    s.arow.resize(kKeyTask);
    s.crow.resize(kKeyTask);
    s.local.resize(kKeyTask);
    s.g.resize(kKeyTask);
  }
  core::parallel_for(n_tasks, threads, [&](int64_t task, int thread) {
    Scratch& s = scratch[thread];
    const int64_t k0 = task * kKeyTask, nk = std::min(kKeyTask, p.key_rows - k0);
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    if (start[task] != start[task + 1]) {
      for (int64_t k = 0; k < nk; ++k) to_f32(p.index_key.bytes(k0 + k, 0), p.index_key.dtype, idim, s.keys.data() + k * idim);
      std::fill(s.stamp.begin(), s.stamp.end(), -1);
      int64_t batch = 0;
      for (int64_t e = start[task]; e < start[task + 1];) {
        const int64_t row = entries[e] / topk;
        int64_t group_end = e + 1;
        while (group_end < start[task + 1] && entries[group_end] / topk == row) ++group_end;
        const float* q = iq_rows + row * iheads * idim;
        transpose(q, idim, iheads, idim, s.qt.data(), iheads);  // qt[d][j]
        for (int64_t j = 0; j < iheads; ++j) s.w[j] = p.weights.at(row, j, 0);
        while (e < group_end) {
          // A batch: the row's next entries up to a repeated key (mm() needs distinct C rows).
          int64_t mb = 0;
          for (; e < group_end; ++e, ++mb) {
            const int64_t local = entry_key(e) - k0;
            if (s.stamp[local] == batch) break;
            s.stamp[local] = batch;
            s.local[mb] = local;
            s.g[mb] = p.grad_loss * p.score_grad[entries[e]] * is;
          }
          ++batch;
          // d[b][j] = K[b] . Q[row][j]
          for (int64_t b = 0; b < mb; ++b) {
            s.arow[b] = s.keys.data() + s.local[b] * idim;
            s.crow[b] = s.d.data() + b * iheads;
          }
          mm(mb, iheads, idim, s.arow.data(), 1, s.qt.data(), iheads, s.crow.data(), false);
          for (int64_t b = 0; b < mb; ++b) {
            float* cb = s.coef.data() + b * iheads;
            gate(s.d.data() + b * iheads, s.g[b], s.w.data(), iheads, cb);
            s.arow[b] = cb;
            s.crow[b] = s.acc.data() + s.local[b] * idim;
          }
          // dK[key_b] += sum_j coef[b][j] * Q[row][j]
          mm(mb, idim, iheads, s.arow.data(), 1, q, idim, s.crow.data(), true);
        }
      }
    }
    from_f32(s.acc.data(), qdt, nk * idim, static_cast<char*>(p.d_index_key) + k0 * idim * dtype_size(qdt));
  });
}

}  // namespace

const SparseKlKernels& DSA_KL_SPARSE_KERNELS() {
  static const SparseKlKernels kernels{DSA_KL_LABEL, sparse_fwd, sparse_bwd};
  return kernels;
}

}  // namespace dsa::cpu::kl_kernels
