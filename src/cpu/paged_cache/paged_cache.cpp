// Fused CPU backend of cache_write / cache_gather: the shared token codec
// (core/paged_cache.h) over rows in parallel. Both move a few KiB per token
// (a decode step writes one token per layer), so one portable kernel serves
// every ISA: what costs time here is the memory traffic, not the arithmetic.
#include <algorithm>
#include <vector>

#include "core/thread_pool.h"
#include "ops/paged_cache.h"

namespace dsa::cpu {
namespace {

constexpr std::int64_t kRowsPerTask = 16;

template <class Body>
void over_rows(const CacheRowsProblem& p, const Body& body) {
  const std::int64_t tasks = (p.rows() + kRowsPerTask - 1) / kRowsPerTask;
  if (tasks == 0) return;
  core::parallel_for(tasks, std::min<std::int64_t>(p.num_threads, tasks), [&](std::int64_t task, int) {
    std::vector<float> row(p.cache.layout.dim);
    for (std::int64_t r = task * kRowsPerTask; r < std::min(p.rows(), (task + 1) * kRowsPerTask); ++r) body(r, row.data());
  });
}

}  // namespace

void cache_write(const CacheRowsProblem& p) {
  over_rows(p, [&](std::int64_t r, float* row) {
    if (p.slots[r] < 0) return;
    core::load_row(static_cast<const char*>(p.values) + p.offset(r) * dtype_size(p.dtype), p.dtype,
                   p.cache.layout.dim, row);
    core::encode_token(p.cache, row, p.cache.token(p.slots[r]));
  });
}

void cache_gather(const CacheRowsProblem& p) {
  const std::int64_t dim = p.cache.layout.dim;
  over_rows(p, [&](std::int64_t r, float* row) {
    if (p.slots[r] >= 0) core::decode_token(p.cache, p.cache.token(p.slots[r]), row);
    else std::fill(row, row + dim, 0.0f);
    for (std::int64_t i = 0; i < dim; ++i) core::store_float(p.values, p.dtype, r * dim + i, row[i]);
  });
}

}  // namespace dsa::cpu
