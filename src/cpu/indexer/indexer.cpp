// Fused CPU lightning indexer: streams key tiles through a score microkernel
// and a running per-row top-k, never holding a [T, S] score matrix.
//
// Work is split into tasks of up to kQueryBlock consecutive queries of one
// sequence; each row's result depends only on its own scores, visited in
// ascending key order, so any thread count gives the same bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu_features.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/indexer/score_kernels.h"
#include "ops/indexer.h"

namespace dsa::cpu {
namespace {

using namespace indexer_kernels;

const ScoreKernel& pick_kernel(DType dtype) {
  switch (core::cpu_isa()) {
    case core::Isa::amx: return dtype == DType::bf16 ? amx_kernel() : avx512_kernel();
    case core::Isa::avx512: return avx512_kernel();
    case core::Isa::avx2: return avx2_kernel();
    default: return portable_kernel();
  }
}

// Larger score -> larger key; NaN below everything; -0 and +0 equal.
inline std::int32_t order_key(float score) {
  if (score != score) return INT32_MIN;
  score += 0.0f;
  std::int32_t bits;
  std::memcpy(&bits, &score, 4);
  return bits < 0 ? bits ^ 0x7fffffff : bits;
}

// Unique rank of a candidate: score first, then the smaller position.
inline std::uint64_t rank_key(float score, std::int32_t position) {
  const std::uint32_t s = static_cast<std::uint32_t>(order_key(score)) ^ 0x80000000u;
  return (static_cast<std::uint64_t>(s) << 32) | (0xffffffffu - static_cast<std::uint32_t>(position));
}

// Running top-k of one query row. Candidates are appended in ascending
// position; when the buffer fills, it is cut back to the k best (keeping
// position order) and the k-th best score becomes the entry threshold.
struct RowTopK {
  std::int32_t* positions;
  float* scores;
  std::int64_t count = 0;
  bool has_threshold = false;
  std::int32_t threshold = INT32_MIN;  // order_key a new score must exceed

  void push(const float* tile_scores, std::int64_t first_position, std::int64_t n) {
    if (!has_threshold) {
      for (std::int64_t s = 0; s < n; ++s) {
        positions[count] = static_cast<std::int32_t>(first_position + s);
        scores[count++] = tile_scores[s];
      }
      return;
    }
    for (std::int64_t s = 0; s < n; ++s) {
      const float v = tile_scores[s];
      if (order_key(v) > threshold) {
        positions[count] = static_cast<std::int32_t>(first_position + s);
        scores[count++] = v;
      }
    }
  }

  void cut_to(std::int64_t k, std::uint64_t* keys) {
    if (count <= k) return;
    for (std::int64_t i = 0; i < count; ++i) keys[i] = rank_key(scores[i], positions[i]);
    std::nth_element(keys, keys + (k - 1), keys + count, std::greater<std::uint64_t>());
    const std::uint64_t kth = keys[k - 1];
    std::int64_t kept = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      if (rank_key(scores[i], positions[i]) >= kth) {
        positions[kept] = positions[i];
        scores[kept++] = scores[i];
      }
    }
    count = kept;
    has_threshold = true;
    threshold = static_cast<std::int32_t>(static_cast<std::uint32_t>(kth >> 32) ^ 0x80000000u);
  }
};

struct Task {
  std::int64_t seq, first, tokens;
  std::int64_t cost;
};

struct ThreadScratch {
  std::vector<std::uint8_t> packed_query;
  std::vector<std::uint8_t> key_scratch;
  std::vector<float> weights, tile;
  std::vector<std::int32_t> positions;
  std::vector<float> scores;
  std::vector<std::uint64_t> keys;
};

}  // namespace

void indexer_topk(const IndexerProblem& p) {
  const ScoreKernel& kernel = pick_kernel(p.dtype);
  for (std::int64_t row : core::padding_rows(p.plan)) {
    std::fill(p.indices + row * p.topk, p.indices + (row + 1) * p.topk, -1);
    if (p.scores) std::fill(p.scores + row * p.topk, p.scores + (row + 1) * p.topk, core::kNegInf);
  }

  std::vector<Task> tasks;
  std::int64_t max_visible = 0;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(p.plan.seqs.size()); ++b) {
    const auto& seq = p.plan.seqs[b];
    for (std::int64_t first = 0; first < seq.q_len; first += kQueryBlock) {
      const std::int64_t tokens = std::min(kQueryBlock, seq.q_len - first);
      const std::int64_t visible = visible_compressed(seq.position(first + tokens - 1), p.ratio);
      max_visible = std::max(max_visible, visible);
      tasks.push_back({b, first, tokens, tokens * (visible + 1)});
    }
  }
  // Longest tasks first balances the causal triangle; the order never changes results.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  // Candidate buffer: room for 2k before a cut, plus one tile of overflow.
  const std::int64_t capacity = std::min(2 * p.topk, max_visible) + kKeyTile;
  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(tasks.size())));
  std::vector<ThreadScratch> scratch(threads);
  for (auto& s : scratch) {
    s.packed_query.resize(kernel.packed_query_bytes(p.heads, p.dim) + 64);
    s.key_scratch.resize(kernel.key_scratch_bytes(p.dim) + 64);
    s.weights.resize(kQueryBlock * p.heads);
    s.tile.resize(kQueryBlock * kKeyTile);
    s.positions.resize(kQueryBlock * capacity);
    s.scores.resize(kQueryBlock * capacity);
    s.keys.resize(capacity);
  }
  auto aligned = [](std::vector<std::uint8_t>& v) {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t(63));
  };
  const std::size_t esize = dtype_size(p.dtype);

  core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t task_index, int thread) {
    const Task& task = tasks[task_index];
    const auto& seq = p.plan.seqs[task.seq];
    ThreadScratch& s = scratch[thread];
    const std::int64_t row0 = seq.q_begin + task.first;

    QueryBlockSource block{static_cast<const char*>(p.query) + row0 * p.query_row_stride * esize,
                           p.dtype, p.query_row_stride, p.query_head_stride,
                           task.tokens, p.heads, p.dim};
    void* packed = aligned(s.packed_query);
    void* key_scratch = aligned(s.key_scratch);
    kernel.pack_queries(block, packed);
    for (std::int64_t t = 0; t < task.tokens; ++t)
      for (std::int64_t h = 0; h < p.heads; ++h)
        s.weights[t * p.heads + h] =
            p.scale * core::load_float(p.weights, p.weights_dtype,
                                       (row0 + t) * p.weights_row_stride + h * p.weights_head_stride);

    std::int64_t visible[kQueryBlock];
    RowTopK rows[kQueryBlock];
    for (std::int64_t t = 0; t < task.tokens; ++t) {
      visible[t] = visible_compressed(seq.position(task.first + t), p.ratio);
      rows[t].positions = s.positions.data() + t * capacity;
      rows[t].scores = s.scores.data() + t * capacity;
    }
    const std::int64_t last_visible = visible[task.tokens - 1];
    for (std::int64_t k0 = 0; k0 < last_visible; k0 += kKeyTile) {
      const std::int64_t n = std::min(kKeyTile, last_visible - k0);
      KeyTileSource keys{static_cast<const char*>(p.key) + (seq.c_begin + k0) * p.key_row_stride * esize,
                         p.dtype, p.key_row_stride, n};
      kernel.score_tile(packed, block, s.weights.data(), keys, key_scratch, s.tile.data());
      for (std::int64_t t = 0; t < task.tokens; ++t) {
        const std::int64_t count = std::min(n, visible[t] - k0);
        if (count <= 0) continue;
        RowTopK& row = rows[t];
        if (row.count + count > capacity) row.cut_to(p.topk, s.keys.data());
        row.push(s.tile.data() + t * kKeyTile, k0, count);
      }
    }
    for (std::int64_t t = 0; t < task.tokens; ++t) {
      RowTopK& row = rows[t];
      row.cut_to(p.topk, s.keys.data());
      std::int32_t* out_idx = p.indices + (row0 + t) * p.topk;
      std::memcpy(out_idx, row.positions, row.count * sizeof(std::int32_t));
      std::fill(out_idx + row.count, out_idx + p.topk, -1);
      if (p.scores) {
        float* out_scores = p.scores + (row0 + t) * p.topk;
        std::memcpy(out_scores, row.scores, row.count * sizeof(float));
        std::fill(out_scores + row.count, out_scores + p.topk, core::kNegInf);
      }
    }
  });
}

}  // namespace dsa::cpu
