// Fused CPU backend of cache_write / cache_gather: the shared token codec
// (core/paged_cache.h) over rows in parallel. Both move a few KiB per token
// (a decode step writes one token per layer), so one portable kernel serves
// every ISA: what costs time here is the memory traffic, not the arithmetic
// (a gather to bf16 borrows the decode kernels' vector FP8 pass).
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/paged_cache/dequant.h"
#include "ops/paged_cache.h"

namespace dsa::cpu {
namespace {

constexpr std::int64_t kRowsPerTask = 16;

template <class Body>
void over_rows(const CacheRowsProblem& p, const Body& body) {
  const std::int64_t tasks = (p.rows() + kRowsPerTask - 1) / kRowsPerTask;
  if (tasks == 0) return;
  // One fp32 row buffer per thread, made before the tasks (not one per task).
  const int threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, tasks));
  std::vector<std::vector<float>> rows(std::max(threads, 1), std::vector<float>(p.cache.layout.dim));
  core::parallel_for(tasks, threads, [&](std::int64_t task, int thread) {
    float* row = rows[thread].data();
    for (std::int64_t r = task * kRowsPerTask; r < std::min(p.rows(), (task + 1) * kRowsPerTask); ++r) body(r, row);
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
  const std::size_t es = dtype_size(p.dtype);
  auto out_row = [&](std::int64_t r) { return static_cast<char*>(p.values) + r * dim * static_cast<std::int64_t>(es); };
  // Records that are rows of the output dtype are copied as they lie; bf16 output
  // from FP8 (or fp32) records goes through the decode kernels' vector dequantiser.
  // Both give the bytes of the element-wise path below (FP8 values times their
  // power-of-two scales are bf16 values exactly), which took ~28 ms for 32768
  // 576-value bf16 records on 2 Zen 4 cores, a float conversion per element.
  if (dequant::records_are_rows(p.cache, p.dtype)) {
    over_rows(p, [&](std::int64_t r, float*) {
      if (p.slots[r] >= 0) std::memcpy(out_row(r), p.cache.token(p.slots[r]), dim * es);
      else std::memset(out_row(r), 0, dim * es);
    });
    return;
  }
  if (p.dtype == DType::bf16) {
    const dequant::Fp8Dequant& fp8 = dequant::pick_fp8_dequant();
    over_rows(p, [&](std::int64_t r, float*) {
      auto* out = reinterpret_cast<std::uint16_t*>(out_row(r));
      if (p.slots[r] >= 0) dequant::record_to_bf16(p.cache, p.cache.token(p.slots[r]), out, fp8);
      else std::memset(out, 0, dim * es);
    });
    return;
  }
  over_rows(p, [&](std::int64_t r, float* row) {
    if (p.slots[r] >= 0) core::decode_token(p.cache, p.cache.token(p.slots[r]), row);
    else std::fill(row, row + dim, 0.0f);
    for (std::int64_t i = 0; i < dim; ++i) core::store_float(p.values, p.dtype, r * dim + i, row[i]);
  });
}

}  // namespace dsa::cpu
