// Fused CPU paged decode indexer: the prefill indexer's score kernels
// (score_kernels.h, picked per ISA) over key tiles read from the paged cache,
// and its running top-k (row_topk.h). No [B, context] score buffer: scores
// live in one [rows][kKeyTile] tile per thread.
//
// Keys: a bf16 or fp32 tile inside one block is scored in place (a block's
// records are rows of `dim` values at a stride of `dim`); an FP8 tile, one
// crossing blocks, or a storage dtype other than the kernel's is dequantised
// into a per-thread tile first. bf16 queries over bf16 or FP8 keys are scored
// in bf16 (FP8 values are bf16 values exactly), anything else in fp32. Kernels
// that compute in fp32 FMAs whatever the dtype get dequantised tiles in fp32.
//
// A request's keys are cut into segments (at most kMaxSegments, from the
// problem alone), one task each, so that one request keeps every core busy;
// each segment keeps its rows' top-k, and the segments' candidates, in
// position order, are cut to the final top-k. The selection is a function of
// the scores alone (equal scores keep the smaller position), so no split
// changes a bit.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/memory.h"
#include "core/numeric.h"
#include "core/thread_pool.h"
#include "cpu/indexer/row_topk.h"
#include "cpu/paged_cache/dequant.h"
#include "cpu/score/score_kernels.h"
#include "cpu/select.h"
#include "ops/indexer_decode.h"

namespace dsa::cpu {
namespace {

using namespace indexer_kernels;

constexpr std::int64_t kTargetTasks = 32;
constexpr std::int64_t kMaxSegments = 16;
constexpr std::int64_t kMinSegment = 2048;  // keys: below this a split costs more than it spreads

constexpr Candidate<CandidateFilter, DType> kFilters[] = {
    {core::Isa::avx512, avx512_filter},
    {core::Isa::portable, portable_filter},
};

struct Task {
  std::int64_t b, row0, rows;  // rows [row0, row0 + rows) of request b (a query block)
  std::int64_t segment, lo, hi;  // keys [lo, hi) of the request's stream
};

struct ThreadScratch {
  core::ScratchVector<std::uint8_t> packed_query, key_scratch, tile_keys;
  std::vector<float> query, weights, tile;
  std::vector<std::int32_t> positions;
  std::vector<std::uint32_t> keys, boundary;
};

void* aligned64(core::ScratchVector<std::uint8_t>& v) {
  return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t(63));
}

}  // namespace

void indexer_decode(const IndexerDecodeProblem& p) {
  const std::int64_t rows = p.rows(), topk = p.topk, D = p.dim, H = p.heads;
  if (rows == 0) return;
  const DType kdt = dequant::kernel_dtype(p.dtype, {&p.keys});
  const std::size_t qes = dtype_size(p.dtype);
  const bool in_place = dequant::records_are_rows(p.keys, kdt);
  const ScoreKernel& kernel = pick_score_kernel(kdt);
  const AppendCandidatesFn append = select_kernel(kFilters, kdt).append;
  const dequant::Fp8Dequant& fp8 = dequant::pick_fp8_dequant();
  // The dtype of a key tile: the records' own in place; dequantised, fp32 for the
  // kernels that widen keys anyway where the FP8 kernel has a vector fp32 route (an
  // FP8 code goes to fp32 in fewer operations than to bf16 and back).
  const DType tdt =
      !in_place && kdt == DType::bf16 && kernel.accepts_f32_keys && fp8.has_f32_route() ? DType::f32 : kdt;
  const std::size_t tes = dtype_size(tdt);

  // Segments per request, from the problem alone.
  const std::int64_t max_segments = std::clamp<std::int64_t>((kTargetTasks + p.batch - 1) / p.batch, 1, kMaxSegments);
  std::vector<std::int64_t> segments(p.batch);
  std::vector<Task> tasks;
  std::int64_t max_span = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t keys = p.visible(b, p.next_n - 1);
    segments[b] = std::clamp<std::int64_t>(keys / kMinSegment, 1, max_segments);
    for (std::int64_t row0 = 0; row0 < p.next_n; row0 += kQueryBlock)
      for (std::int64_t g = 0; g < segments[b]; ++g) {
        const std::int64_t lo = keys * g / segments[b], hi = keys * (g + 1) / segments[b];
        tasks.push_back({b, row0, std::min(kQueryBlock, p.next_n - row0), g, lo, hi});
        max_span = std::max(max_span, hi - lo);
      }
  }
  // Each (row, segment) keeps at most topk candidates until the merge.
  std::vector<std::int64_t> seg_count(rows * max_segments, 0);
  std::vector<std::int32_t> seg_positions;
  std::vector<std::uint32_t> seg_keys;
  const bool split = std::any_of(segments.begin(), segments.end(), [](std::int64_t s) { return s > 1; });
  if (split) {
    seg_positions.resize(static_cast<std::size_t>(rows * max_segments * topk));
    seg_keys.resize(seg_positions.size());
  }

  const std::int64_t capacity = std::min(2 * topk, max_span) + kKeyTile;
  const int threads = std::max(1, std::min<int>(p.num_threads, static_cast<int>(tasks.size())));
  std::vector<ThreadScratch> scratch(threads);
  for (auto& s : scratch) {
    s.packed_query.resize(kernel.packed_query_bytes(H, D) + 64);
    s.key_scratch.resize(kernel.key_scratch_bytes(D) + 64);
    s.tile_keys.resize(static_cast<std::size_t>(kKeyTile * D) * tes + 64);
    s.query.resize(p.dtype == kdt ? 0 : kQueryBlock * H * D);
    s.weights.resize(kQueryBlock * H);
    s.tile.resize(kQueryBlock * kKeyTile);
    s.positions.resize(kQueryBlock * capacity);
    s.keys.resize(kQueryBlock * capacity);
    s.boundary.resize(std::max(capacity, max_segments * topk));
  }

  core::parallel_for(static_cast<std::int64_t>(tasks.size()), threads, [&](std::int64_t ti, int thread) {
    const Task& task = tasks[ti];
    ThreadScratch& s = scratch[thread];
    const std::int64_t b = task.b;
    QueryBlockSource block{static_cast<const char*>(p.query) + (b * p.q_batch_stride + task.row0 * p.q_row_stride) * qes,
                           kdt, p.q_row_stride, p.q_head_stride, task.rows, H, D};
    if (p.dtype != kdt) {  // fp32 scoring of an fp16 or bf16 query
      for (std::int64_t t = 0; t < task.rows; ++t)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t d = 0; d < D; ++d)
            s.query[(t * H + h) * D + d] = core::load_float(
                p.query, p.dtype, b * p.q_batch_stride + (task.row0 + t) * p.q_row_stride + h * p.q_head_stride + d);
      block.query = s.query.data();
      block.row_stride = H * D;
      block.head_stride = D;
    }
    void* packed = aligned64(s.packed_query);
    kernel.pack_queries(block, packed);
    for (std::int64_t t = 0; t < task.rows; ++t)
      for (std::int64_t h = 0; h < H; ++h) s.weights[t * H + h] = p.scale * p.weight(b, task.row0 + t, h);

    std::int64_t visible[kQueryBlock];
    RowTopK top[kQueryBlock];
    for (std::int64_t t = 0; t < task.rows; ++t) {
      visible[t] = std::min(task.hi, p.visible(b, task.row0 + t));
      top[t].positions = s.positions.data() + t * capacity;
      top[t].keys = s.keys.data() + t * capacity;
    }
    const std::int64_t end = visible[task.rows - 1], bs = p.keys.block_size;
    char* tile_keys = static_cast<char*>(aligned64(s.tile_keys));
    for (std::int64_t k0 = task.lo; k0 < end;) {
      std::int64_t n = std::min(kKeyTile, end - k0);
      KeyTileSource keys{tile_keys, tdt, D, 0};
      if (in_place && k0 % bs + n > bs) n = bs - k0 % bs;  // in place: the tile stays in its block
      if (in_place) {
        keys.keys = p.keys.token(p.table.slot(b, k0));
      } else {
        for (std::int64_t k = 0; k < n; ++k) {
          const std::uint8_t* rec = p.keys.token(p.table.slot(b, k0 + k));
          char* dst = tile_keys + k * D * tes;
          if (kdt == DType::f32) core::decode_token(p.keys, rec, reinterpret_cast<float*>(dst));
          else if (tdt == DType::f32) dequant::record_to_f32(p.keys, rec, reinterpret_cast<float*>(dst), fp8);
          else dequant::record_to_bf16(p.keys, rec, reinterpret_cast<std::uint16_t*>(dst), fp8);
        }
      }
      keys.count = n;
      kernel.score_tile(packed, block, s.weights.data(), keys, aligned64(s.key_scratch), s.tile.data());
      for (std::int64_t t = 0; t < task.rows; ++t) {
        const std::int64_t count = std::min(n, visible[t] - k0);
        if (count <= 0) continue;
        if (top[t].count + count > capacity) top[t].cut_to(topk, s.boundary.data());
        top[t].push(append, s.tile.data() + t * kKeyTile, k0, count);
      }
      k0 += n;
    }
    for (std::int64_t t = 0; t < task.rows; ++t) {
      RowTopK& row = top[t];
      row.cut_to(topk, s.boundary.data());
      const std::int64_t r = b * p.next_n + task.row0 + t;
      if (segments[b] == 1) {
        std::int32_t* out = p.indices + r * topk;
        std::memcpy(out, row.positions, row.count * sizeof(std::int32_t));
        std::fill(out + row.count, out + topk, -1);
        continue;
      }
      const std::int64_t at = (r * max_segments + task.segment) * topk;
      std::memcpy(seg_positions.data() + at, row.positions, row.count * sizeof(std::int32_t));
      std::memcpy(seg_keys.data() + at, row.keys, row.count * sizeof(std::uint32_t));
      seg_count[r * max_segments + task.segment] = row.count;
    }
  });
  if (!split) return;

  // Split requests: the segments' candidates, in position order, cut to topk.
  core::parallel_for(rows, std::max(1, std::min<int>(p.num_threads, static_cast<int>(rows))), [&](std::int64_t r, int thread) {
    const std::int64_t b = r / p.next_n;
    if (segments[b] == 1) return;
    ThreadScratch& s = scratch[thread];
    std::vector<std::uint32_t> keys;
    std::vector<std::int32_t> positions;
    for (std::int64_t g = 0; g < segments[b]; ++g) {
      const std::int64_t at = (r * max_segments + g) * topk, n = seg_count[r * max_segments + g];
      keys.insert(keys.end(), seg_keys.begin() + at, seg_keys.begin() + at + n);
      positions.insert(positions.end(), seg_positions.begin() + at, seg_positions.begin() + at + n);
    }
    RowTopK row;
    row.keys = keys.data();
    row.positions = positions.data();
    row.count = static_cast<std::int64_t>(keys.size());
    row.cut_to(topk, s.boundary.data());
    std::int32_t* out = p.indices + r * topk;
    std::memcpy(out, row.positions, row.count * sizeof(std::int32_t));
    std::fill(out + row.count, out + topk, -1);
  });
}

}  // namespace dsa::cpu
