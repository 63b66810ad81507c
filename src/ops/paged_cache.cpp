// dsa::cache_write / cache_gather: validation, the slot of every row, dispatch.
#include "ops/paged_cache.h"

#include <algorithm>

#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"

namespace dsa {
namespace {

// Shared by both ops: validates the cache, the block table and positions
// against the [B, n, dim] row tensor, and maps every row to its slot.
CacheRowsProblem rows_problem(const TensorView& cache, const TensorView& block_table,
                              const TensorView& positions, const TensorView& rows, const char* rows_name,
                              const CacheWriteParams& params) {
  using namespace core;
  CacheRowsProblem p;
  p.cache = validate_paged_cache(cache, params.layout, "cache");
  require_present(rows, rows_name);
  require_cpu(rows, rows_name);
  require_ndim(rows, rows_name, {3}, "[B, n, dim]");
  require_size(rows, rows_name, 2, params.layout.dim, "dim, the values per cached token");
  require_last_dim_contiguous(rows, rows_name);
  require_present(positions, "positions");
  require_cpu(positions, "positions");
  require_dtype(positions, "positions", {DType::i32, DType::i64});
  require_ndim(positions, "positions", {2}, "[B, n]");
  const std::int64_t batch = rows.size(0);
  p.n = rows.size(1);
  require_size(positions, "positions", 0, batch, "B of the rows");
  require_size(positions, "positions", 1, p.n, "n of the rows");
  const BlockTable table = validate_block_table(block_table, batch, p.cache, "block_table");

  p.slots.assign(batch * p.n, -1);
  // No rows, no work: a [2^40, 0, dim] view is legal and costs nothing, and
  // looping over its batch dim alone was fuzz_decode's timeout (be8973ca).
  for (std::int64_t b = 0; p.n > 0 && b < batch; ++b)
    for (std::int64_t i = 0; i < p.n; ++i) {
      const std::int64_t at = b * positions.stride(0) + i * positions.stride(1);
      const std::int64_t pos = positions.dtype == DType::i32 ? positions.ptr<const std::int32_t>()[at]
                                                             : positions.ptr<const std::int64_t>()[at];
      if (pos == -1) continue;
      if (pos < 0) fail_argument("positions[", b, ", ", i, "] = ", pos, ": expected a position >= 0, or -1 to skip");
      require_covered(table, b, pos, pos + 1, "positions");
      p.slots[b * p.n + i] = table.slot(b, pos);
    }
  p.values = rows.data;
  p.dtype = rows.dtype;
  p.batch_stride = rows.stride(0);
  p.row_stride = rows.stride(1);
  p.num_threads = resolve_num_threads(params.num_threads);
  return p;
}

}  // namespace

void cache_write(const TensorView& cache, const TensorView& block_table, const TensorView& positions,
                 const TensorView& values, const CacheWriteParams& params, Backend backend) {
  using namespace core;
  require_float_input(values, "values", {3}, "[B, n, dim]");
  CacheRowsProblem p = rows_problem(cache, block_table, positions, values, "values", params);
  backend = resolve_backend(backend, cache.device);
  // Two rows into one slot: which one stays would depend on the order of the
  // writes (threads), so it is refused. Blocks shared between requests are the
  // caller's business (prefix sharing), but never one slot written twice.
  std::vector<std::int64_t> sorted;
  sorted.reserve(p.slots.size());
  for (std::int64_t s : p.slots)
    if (s >= 0) sorted.push_back(s);
  std::sort(sorted.begin(), sorted.end());
  if (const auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end())
    fail_argument("positions: two rows are written to the same cache slot (block ", *dup / p.cache.block_size,
                  ", row ", *dup % p.cache.block_size, ")");
  ops::dispatch(&ops::OpTable::cache_write, backend, p);
}

void cache_gather(const TensorView& cache, const TensorView& block_table, const TensorView& positions,
                  const CacheWriteParams& params, const TensorView& out, Backend backend) {
  using namespace core;
  require_present(out, "out");
  require_cpu(out, "out");
  require_dtype(out, "out", {DType::f32, DType::bf16});
  require_contiguous(out, "out");
  CacheRowsProblem p = rows_problem(cache, block_table, positions, out, "out", params);
  backend = resolve_backend(backend, cache.device);
  ops::dispatch(&ops::OpTable::cache_gather, backend, p);
}

}  // namespace dsa
