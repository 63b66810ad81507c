// Fused CPU lightning indexer: streams key tiles through a score microkernel
// and a running per-row top-k, never holding a [T, S] score matrix.
//
// Work is split into tasks of up to kQueryBlock consecutive queries of one
// sequence; each row's result depends only on its own scores, visited in
// ascending key order, so any thread count gives the same bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/indexer/row_topk.h"
#include "cpu/score/score_kernels.h"
#include "cpu/select.h"
#include "ops/indexer.h"

namespace dsa::cpu {

namespace {

constexpr Candidate<indexer_kernels::CandidateFilter, DType> kCandidateFilters[] = {
    {core::Isa::avx512, indexer_kernels::avx512_filter},
    {core::Isa::portable, indexer_kernels::portable_filter},
};


using namespace indexer_kernels;

using Task = core::QueryBlock;

struct ThreadScratch {
  core::ScratchVector<std::uint8_t> packed_query;  // dsa's allocator: a failure names its size
  core::ScratchVector<std::uint8_t> key_scratch;
  std::vector<float> weights, tile;
  std::vector<std::int32_t> positions;
  std::vector<std::uint32_t> keys;
  std::vector<std::uint32_t> boundary;  // radix-select scratch of one row
};

}  // namespace

void indexer_topk(const IndexerProblem& p) {
  // No query rows: nothing to write, and nothing may be sized from the shapes,
  // which no memory bounds then (a [0, 2^40, 1] query or topk = INT64_MAX are
  // legal; 2 * topk below overflowed, found by fuzz_indexer).
  if (p.plan.q_rows == 0) return;
  const ScoreKernel& kernel = pick_score_kernel(p.dtype);
  const AppendCandidatesFn append = select_kernel(kCandidateFilters, p.dtype).append;
  for (std::int64_t row : core::padding_rows(p.plan)) {
    std::fill(p.indices + row * p.topk, p.indices + (row + 1) * p.topk, -1);
    if (p.scores) std::fill(p.scores + row * p.topk, p.scores + (row + 1) * p.topk, core::kNegInf);
  }

  std::int64_t max_visible = 0;
  const std::vector<Task> tasks = core::query_blocks(
      p.plan, kQueryBlock, [&](const core::SequenceSlice& seq, std::int64_t first, std::int64_t tokens) {
        const std::int64_t visible = visible_compressed(seq.position(first + tokens - 1), p.ratio);
        max_visible = std::max(max_visible, visible);
        return tokens * (visible + 1);
      });

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
    s.keys.resize(kQueryBlock * capacity);
    s.boundary.resize(capacity);
  }
  auto aligned = [](core::ScratchVector<std::uint8_t>& v) {
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

    std::int64_t visible[kQueryBlock] = {};  // task.tokens >= 1, but GCC 12 cannot see it
    RowTopK rows[kQueryBlock];
    for (std::int64_t t = 0; t < task.tokens; ++t) {
      visible[t] = visible_compressed(seq.position(task.first + t), p.ratio);
      rows[t].positions = s.positions.data() + t * capacity;
      rows[t].keys = s.keys.data() + t * capacity;
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
        if (row.count + count > capacity) row.cut_to(p.topk, s.boundary.data());
        row.push(append, s.tile.data() + t * kKeyTile, k0, count);
      }
    }
    for (std::int64_t t = 0; t < task.tokens; ++t) {
      RowTopK& row = rows[t];
      row.cut_to(p.topk, s.boundary.data());
      std::int32_t* out_idx = p.indices + (row0 + t) * p.topk;
      std::memcpy(out_idx, row.positions, row.count * sizeof(std::int32_t));
      std::fill(out_idx + row.count, out_idx + p.topk, -1);
      if (p.scores) {
        float* out_scores = p.scores + (row0 + t) * p.topk;
        for (std::int64_t j = 0; j < row.count; ++j) out_scores[j] = key_score(row.keys[j]);
        std::fill(out_scores + row.count, out_scores + p.topk, core::kNegInf);
      }
    }
  });
}

}  // namespace dsa::cpu
