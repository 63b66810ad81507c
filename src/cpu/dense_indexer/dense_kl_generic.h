// The generic dense-indexer KL kernels (spec 4.4): see kl_generic_common.h for who includes them.
#pragma once

#include "cpu/dense_indexer/dense_kl_kernels.h"
#include "cpu/isa/kl_generic_common.h"

namespace dsa::cpu::kl_kernels {
namespace {

// An lse of +inf marks an empty row; a NaN one is counted (its NaN reaches the loss).
bool counted_row(const DenseKlProblem& p, const core::SequenceSlice& seq, int64_t i) {
  return seq.position(i) >= 0 && !std::isinf(p.lse[seq.q_begin + i]);
}

// One block of up to kQueryBlock queries of a sequence against 32-key tiles:
// the teacher p, the indexer dots and scores, and (backward) g.
//
// The teacher's logits come in two orientations with the same per-element
// chains and operations, so both give the same bits:
// - the query-major passes (forward, dQ/dW) stream key tiles past one query
//   block: logits^T = K . Q^T, the block's queries transposed once per block
//   ([H][dq][kQueryBlock]) and each tile's key rows only converted, one GEMM
//   per head over the whole tile;
// - the key-major pass (dK) streams query blocks past one key tile:
//   logits = Q . K^T with the tile transposed once per task ([Hk][dq][kTile]).
struct DenseBlock {
  const DenseKlProblem& p;
  int64_t heads, key_heads, group, dq, iheads, idim;
  std::vector<float> qa;      // [Hk][tokens][group][dq]
  std::vector<float> qt;      // [H][dq][kQueryBlock] (query-major passes), columns past tokens 0
  std::vector<float> ia;      // [tokens][Hi][Di]
  std::vector<float> w;       // [tokens][Hi], times index_scale
  std::vector<float> max, inv_den;      // [tokens][H]
  std::vector<float> neg_max_t, inv_t;  // [H][kQueryBlock], past tokens 0
  std::vector<float> kt;      // [kDenseKeyTiles][Hk][dq][kTile] (key-major pass)
  std::vector<float> krow;    // [kTile][dq]: one key head's rows
  std::vector<float> ikt;     // [kDenseKeyTiles][Di][kTile] (the query-major passes use the first)
  std::vector<float> krows;   // [kTile][Di]
  std::vector<float> logits;  // [tokens * group][kTile] or [kTile][kQueryBlock]
  std::vector<float> idots;   // [tokens][Hi][kTile]
  std::vector<float> coef;    // [tokens][Hi][kTile]: the gradient's per-(token, head, key) factors
  std::vector<const float*> arow;
  std::vector<float*> crow;
  std::vector<int64_t> key_rows;
  float teacher[kQueryBlock][kTile], score[kQueryBlock][kTile], g[kQueryBlock][kTile];
  float teacher_t[kTile][kQueryBlock];
  int64_t tokens = 0, row0 = 0, visible[kQueryBlock];
  float lse[kQueryBlock];
  bool counted[kQueryBlock];

  // key_major: the dK pass's block (packed key tiles, no transposed queries);
  // each pass sizes only the buffers it uses.
  DenseBlock(const DenseKlProblem& problem, bool key_major) : p(problem) {
    heads = p.query.heads;
    key_heads = p.key.heads;
    group = heads / key_heads;
    dq = p.query.dim + (p.query_rope.present() ? p.query_rope.dim : 0);
    iheads = p.index_query.heads;
    idim = p.index_query.dim;
    size_scratch(qa, kQueryBlock * heads * dq);
    size_scratch(qt, key_major ? 0 : heads * dq * kQueryBlock);
    size_scratch(ia, kQueryBlock * iheads * idim);
    size_scratch(w, kQueryBlock * iheads);
    size_scratch(max, kQueryBlock * heads);
    size_scratch(inv_den, kQueryBlock * heads);
    size_scratch(neg_max_t, key_major ? 0 : heads * kQueryBlock);
    size_scratch(inv_t, key_major ? 0 : heads * kQueryBlock);
    size_scratch(kt, key_major ? kDenseKeyTiles * key_heads * dq * kTile : 0);
    size_scratch(krow, kTile * dq);
    size_scratch(ikt, kDenseKeyTiles * idim * kTile);
    size_scratch(krows, kTile * idim);
    size_scratch(logits, std::max(kQueryBlock * group, kQueryBlock) * kTile);
    size_scratch(idots, kQueryBlock * iheads * kTile);
    size_scratch(coef, kQueryBlock * iheads * kTile);
    arow.resize(std::max(kQueryBlock * iheads, kTile));
    crow.resize(std::max(kQueryBlock * iheads, kTile));
    key_rows.resize(kTile);
  }

  // transposed: also build qt, neg_max_t and inv_t (the query-major passes).
  void load_queries(const core::SequenceSlice& seq, int64_t first, int64_t count, bool transposed) {
    tokens = count;
    row0 = seq.q_begin + first;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t r = row0 + t;
      visible[t] = seq.position(first + t) + 1;
      counted[t] = counted_row(p, seq, first + t);
      lse[t] = p.lse[r];
      for (int64_t kh = 0; kh < key_heads; ++kh)
        pack_heads(p.query, p.query_rope, r, kh * group, group, qa.data() + ((kh * tokens + t) * group) * dq);
      pack_heads(p.index_query, HeadMatrix{}, r, 0, iheads, ia.data() + t * iheads * idim);
      for (int64_t j = 0; j < iheads; ++j) w[t * iheads + j] = p.index_scale * p.weights.at(r, j, 0);
      for (int64_t h = 0; h < heads; ++h) {
        max[t * heads + h] = p.softmax_max[r * heads + h];
        inv_den[t * heads + h] = inverse_denominator(max[t * heads + h], p.softmax_sum[r * heads + h], nullptr);
      }
    }
    if (!transposed) return;
    if (tokens < kQueryBlock) {
      std::fill(qt.begin(), qt.end(), 0.0f);
      std::fill(neg_max_t.begin(), neg_max_t.end(), 0.0f);
      std::fill(inv_t.begin(), inv_t.end(), 0.0f);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kh = h / group, hh = h % group;
      transpose(qa.data() + (kh * tokens * group + hh) * dq, group * dq, tokens, dq,
                qt.data() + h * dq * kQueryBlock, kQueryBlock);
      for (int64_t t = 0; t < tokens; ++t) {
        neg_max_t[h * kQueryBlock + t] = -max[t * heads + h];
        inv_t[h * kQueryBlock + t] = inv_den[t * heads + h];
      }
    }
  }

  void set_keys(const core::SequenceSlice& seq, int64_t k0, int64_t n) {
    for (int64_t s = 0; s < n; ++s) key_rows[s] = seq.k_begin + k0 + s;
  }

  // Key-major pass: transpose tile `u`'s keys [k0, k0 + n) of every key head, and its index keys, once.
  void pack_keys(const core::SequenceSlice& seq, int64_t u, int64_t k0, int64_t n) {
    set_keys(seq, k0, n);
    for (int64_t kh = 0; kh < key_heads; ++kh)
      pack_key_tile(p.key, p.key_rope, key_rows.data(), n, kh, kt.data() + (u * key_heads + kh) * dq * kTile,
                    krow.data());
    pack_key_tile(p.index_key, HeadMatrix{}, key_rows.data(), n, 0, ikt.data() + u * idim * kTile, krows.data());
  }

  // Query-major teacher (sum over heads, before the 1 / H) of keys [k0, k0 + n).
  void teacher_query_major(const core::SequenceSlice& seq, int64_t k0, int64_t n) {
    set_keys(seq, k0, n);
    std::memset(teacher_t, 0, sizeof(teacher_t));
    const int64_t width = p.key.dim + (p.key_rope.present() ? p.key_rope.dim : 0);
    for (int64_t kh = 0; kh < key_heads; ++kh) {
      // The tile's rows of one key head are a head stride apart in memory:
      // prefetch the next head's while this one's GEMMs run.
      if (kh + 1 < key_heads)
        for (int64_t s = 0; s < n; ++s) {
          prefetch(p.key.bytes(key_rows[s], kh + 1), p.key.dim * dtype_size(p.key.dtype));
          if (p.key_rope.present())
            prefetch(p.key_rope.bytes(key_rows[s], kh + 1), p.key_rope.dim * dtype_size(p.key_rope.dtype));
        }
      for (int64_t s = 0; s < n; ++s) {
        float* row = krow.data() + s * width;
        to_f32(p.key.bytes(key_rows[s], kh), p.key.dtype, p.key.dim, row);
        if (p.key_rope.present()) to_f32(p.key_rope.bytes(key_rows[s], kh), p.key_rope.dtype, p.key_rope.dim, row + p.key.dim);
        arow[s] = row;
        crow[s] = logits.data() + s * kQueryBlock;
      }
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t h = kh * group + hh;
        mm(n, kQueryBlock, dq, arow.data(), 1, qt.data() + h * dq * kQueryBlock, kQueryBlock, crow.data(), false);
        add_exp_rows(logits.data(), n, p.scale, neg_max_t.data() + h * kQueryBlock, inv_t.data() + h * kQueryBlock,
                     &teacher_t[0][0]);
      }
    }
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t s = 0; s < kTile; ++s) teacher[t][s] = s < n ? teacher_t[s][t] : 0.0f;
    pack_key_tile(p.index_key, HeadMatrix{}, key_rows.data(), n, 0, ikt.data(), krows.data());
  }

  // Key-major teacher against tile `u` of those pack_keys() packed.
  void teacher_key_major(int64_t u) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t s = 0; s < kTile; ++s) teacher[t][s] = 0.0f;
    for (int64_t kh = 0; kh < key_heads; ++kh) {
      dots(qa.data() + kh * tokens * group * dq, tokens * group, dq, kt.data() + (u * key_heads + kh) * dq * kTile,
           logits.data());
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t h = kh * group + hh;
          const float inv = inv_den[t * heads + h], mx = max[t * heads + h];
          if (inv == 0.0f) continue;  // adds +0 in the query-major form: the same sums
          add_exp_tile(logits.data() + (t * group + hh) * kTile, p.scale, mx, inv, teacher[t]);
        }
    }
  }

  // After a teacher: the indexer dots and scores of keys [k0, k0 + n); teacher
  // normalised and masked (invisible pairs and rows outside the loss get 0), and g.
  void finish(int64_t k0, int64_t n, bool with_grad, float grad_factor, int64_t u = 0) {
    const float inv_heads = 1.0f / static_cast<float>(heads);
    dots(ia.data(), tokens * iheads, idim, ikt.data() + u * idim * kTile, idots.data());
    for (int64_t t = 0; t < tokens; ++t) {
      float sc[kTile] = {};
      for (int64_t j = 0; j < iheads; ++j) {
        const float wj = w[t * iheads + j];
        const float* dj = idots.data() + (t * iheads + j) * kTile;
        for (int64_t s = 0; s < kTile; ++s) sc[s] += wj * relu(dj[s]);
      }
      const int64_t count = counted[t] ? std::max<int64_t>(0, std::min(n, visible[t] - k0)) : 0;
      for (int64_t s = 0; s < kTile; ++s) {
        score[t][s] = sc[s];
        teacher[t][s] = s < count ? teacher[t][s] * inv_heads : 0.0f;
      }
      if (with_grad) grad_tile(sc, lse[t], teacher[t], grad_factor, count, g[t]);
    }
  }

  // coef[t][j][s] = idots > 0 ? g * w : 0; with dw, dw[t][j] += sum_s g * relu(idots) * index_scale.
  void gate_all(float* dw) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < iheads; ++j) {
        const int64_t tj = t * iheads + j;
        const float sum = gate_tile(idots.data() + tj * kTile, g[t], w[tj], coef.data() + tj * kTile);
        if (dw) dw[tj] += sum * p.index_scale;
      }
  }
};

using DenseTask = core::QueryBlock;

std::vector<DenseTask> dense_query_tasks(const core::SequencePlan& plan) {
  return core::query_blocks(plan, kQueryBlock, [](const core::SequenceSlice& seq, int64_t first, int64_t tokens) {
    return tokens * (seq.position(first + tokens - 1) + 2);
  });
}

int64_t dense_counted_rows(const DenseKlProblem& p) {
  int64_t n = 0;
  for (const auto& seq : p.plan.seqs)
    for (int64_t i = 0; i < seq.q_len; ++i) n += counted_row(p, seq, i);
  return n;
}

void dense_fwd(const DenseKlProblem& p) {
  const std::vector<DenseTask> tasks = dense_query_tasks(p.plan);
  std::vector<double> row_kl(p.plan.q_rows, 0.0);
  const int threads = thread_count(std::max<int64_t>(1, tasks.size()), p.num_threads);
  std::vector<DenseBlock> blocks;
  blocks.reserve(threads);
  for (int t = 0; t < (tasks.empty() ? 0 : threads); ++t) blocks.emplace_back(p, false);  // as in sparse_fwd
  core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
    const DenseTask& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    DenseBlock& b = blocks[thread];
    b.load_queries(seq, task.first, task.tokens, true);
    double kl[kQueryBlock] = {};
    const int64_t last = b.visible[b.tokens - 1];
    for (int64_t k0 = 0; k0 < last; k0 += kTile) {
      const int64_t n = std::min(kTile, last - k0);
      b.teacher_query_major(seq, k0, n);
      b.finish(k0, n, false, 0.0f);
      for (int64_t t = 0; t < b.tokens; ++t) {
        const float l = b.lse[t];
        float sum = 0.0f;
        for (int64_t s = 0; s < kTile; ++s) {
          const float pt = b.teacher[t][s];
          // p log p -> 0 as p -> 0; below the normal range the term is under 1e-36.
          sum += !(pt < 1e-37f) ? pt * (fast_log(pt) - (b.score[t][s] - l)) : 0.0f;  // NaN is added
        }
        kl[t] += sum;
      }
    }
    for (int64_t t = 0; t < b.tokens; ++t) row_kl[b.row0 + t] = kl[t];
  });
  double total = 0.0;
  for (double v : row_kl) total += v;
  *p.loss = static_cast<float>(reduction_factor(p.reduction, p.coefficient, dense_counted_rows(p)) * total);
}

void dense_bwd(const DenseKlProblem& p) {
  const float factor =
      static_cast<float>(p.grad_loss * reduction_factor(p.reduction, p.coefficient, dense_counted_rows(p)));
  const DType qdt = p.index_query.dtype, wdt = p.weights.dtype;
  const int64_t iheads = p.index_query.heads, idim = p.index_query.dim;
  std::memset(p.d_index_query, 0, p.plan.q_rows * iheads * idim * dtype_size(qdt));
  std::memset(p.d_weights, 0, p.plan.q_rows * iheads * dtype_size(wdt));
  std::memset(p.d_index_key, 0, p.key_rows * idim * dtype_size(qdt));

  // dQ, dW: tasks own query blocks and stream the key tiles they see;
  // dQ[t][j] += sum_s coef[t][j][s] * K[s] is one GEMM per tile.
  {
    const std::vector<DenseTask> tasks = dense_query_tasks(p.plan);
    const int threads = thread_count(std::max<int64_t>(1, tasks.size()), p.num_threads);
    std::vector<DenseBlock> blocks;
    blocks.reserve(threads);
    const int workers = tasks.empty() ? 0 : threads;  // as in sparse_fwd: no buffers without tasks
    for (int t = 0; t < workers; ++t) blocks.emplace_back(p, false);
    std::vector<std::vector<float>> dq(workers), dw(workers);  // no prototype: it would be sized without tasks
    for (int t = 0; t < workers; ++t) {
      size_scratch(dq[t], kQueryBlock * iheads * idim);
      size_scratch(dw[t], kQueryBlock * iheads);
    }
    core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
      const DenseTask& task = tasks[task_index];
      const auto& seq = p.plan.seqs[task.seq];
      DenseBlock& b = blocks[thread];
      float* dqa = dq[thread].data();
      float* dwa = dw[thread].data();
      std::fill(dq[thread].begin(), dq[thread].end(), 0.0f);
      std::fill(dw[thread].begin(), dw[thread].end(), 0.0f);
      b.load_queries(seq, task.first, task.tokens, true);
      const int64_t rows = b.tokens * iheads;
      const int64_t last = b.visible[b.tokens - 1];
      for (int64_t k0 = 0; k0 < last; k0 += kTile) {
        const int64_t n = std::min(kTile, last - k0);
        b.teacher_query_major(seq, k0, n);
        b.finish(k0, n, true, factor);
        b.gate_all(dwa);
        for (int64_t r = 0; r < rows; ++r) {
          b.arow[r] = b.coef.data() + r * kTile;
          b.crow[r] = dqa + r * idim;
        }
        mm(rows, idim, n, b.arow.data(), 1, b.krows.data(), idim, b.crow.data(), true);
      }
      from_f32(dqa, qdt, b.tokens * iheads * idim,
               static_cast<char*>(p.d_index_query) + b.row0 * iheads * idim * dtype_size(qdt));
      from_f32(dwa, wdt, b.tokens * iheads, static_cast<char*>(p.d_weights) + b.row0 * iheads * dtype_size(wdt));
    });
  }

  // dK: tasks own kDenseKeyTiles 32-key tiles (packed once) and stream the
  // query blocks that see them, each block converted once for all of the
  // task's tiles; dK[s] += sum_{t, j} coef[t][j][s] * Q[t][j] is one GEMM per
  // (block, tile). Each tile sees the blocks it would see alone, in order.
  struct KeyTask {
    int64_t seq, k0, n, cost;
  };
  std::vector<KeyTask> tasks;
  for (int64_t bi = 0; bi < static_cast<int64_t>(p.plan.seqs.size()); ++bi) {
    const auto& seq = p.plan.seqs[bi];
    if (seq.q_len == 0) continue;
    for (int64_t k0 = 0; k0 < seq.k_len; k0 += kDenseKeyTiles * kTile) {
      const int64_t offset = seq.k_len - seq.q_len;  // query i sees keys <= offset + i
      const int64_t first_query = std::max<int64_t>(0, k0 - offset);
      if (first_query >= seq.q_len) continue;
      tasks.push_back({bi, k0, std::min(kDenseKeyTiles * kTile, seq.k_len - k0), seq.q_len - first_query});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const KeyTask& a, const KeyTask& b) { return a.cost > b.cost; });
  const int threads = thread_count(std::max<int64_t>(1, tasks.size()), p.num_threads);
  std::vector<DenseBlock> blocks;
  blocks.reserve(threads);
  const int workers = tasks.empty() ? 0 : threads;  // as in sparse_fwd: no buffers without tasks
  for (int t = 0; t < workers; ++t) blocks.emplace_back(p, true);
  std::vector<std::vector<float>> dk(workers);
  for (auto& v : dk) size_scratch(v, kDenseKeyTiles * kTile * idim);
  core::parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t task_index, int thread) {
    const KeyTask& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    DenseBlock& b = blocks[thread];
    float* dka = dk[thread].data();
    std::fill(dk[thread].begin(), dk[thread].end(), 0.0f);
    const int64_t offset = seq.k_len - seq.q_len;
    // Tile u: keys [k0 + u * kTile, + tile_n[u]), seen from query block
    // first_block[u] on; a tile that no query sees keeps dK = 0 (first_block = q_len).
    int64_t tiles = 0, first_block[kDenseKeyTiles], tile_n[kDenseKeyTiles];
    for (int64_t u = 0; u < kDenseKeyTiles && u * kTile < task.n; ++u, ++tiles) {
      const int64_t k0 = task.k0 + u * kTile, first_query = std::max<int64_t>(0, k0 - offset);
      first_block[u] = first_query < seq.q_len ? first_query / kQueryBlock * kQueryBlock : seq.q_len;
      tile_n[u] = std::min(kTile, task.n - u * kTile);
      b.pack_keys(seq, u, k0, tile_n[u]);
    }
    for (int64_t first = first_block[0]; first < seq.q_len; first += kQueryBlock) {
      b.load_queries(seq, first, std::min(kQueryBlock, seq.q_len - first), false);
      for (int64_t u = 0; u < tiles; ++u) {
        if (first < first_block[u]) continue;
        for (int64_t s = 0; s < tile_n[u]; ++s) {
          b.arow[s] = b.coef.data() + s;  // A(s, (t, j)) = coef[t][j][s]
          b.crow[s] = dka + (u * kTile + s) * idim;
        }
        b.teacher_key_major(u);
        b.finish(task.k0 + u * kTile, tile_n[u], true, factor, u);
        b.gate_all(nullptr);
        mm(tile_n[u], idim, b.tokens * iheads, b.arow.data(), kTile, b.ia.data(), idim, b.crow.data(), true);
      }
    }
    from_f32(dka, qdt, task.n * idim,
             static_cast<char*>(p.d_index_key) + (seq.k_begin + task.k0) * idim * dtype_size(qdt));
  });
}

}  // namespace

const DenseKlKernels& DSA_KL_DENSE_KERNELS() {
  static const DenseKlKernels kernels{DSA_KL_LABEL, dense_fwd, dense_bwd};
  return kernels;
}

}  // namespace dsa::cpu::kl_kernels
