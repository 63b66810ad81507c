// Internal: cache_write / cache_gather after validation, shared by their backends.
#pragma once

#include <cstdint>
#include <vector>

#include "core/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa {

// Token rows moving between a [B, n, dim] tensor and a paged cache.
struct CacheRowsProblem {
  core::PagedCache cache;
  std::vector<std::int64_t> slots;  // [B * n]: the slot of row (b, i), -1: none
  std::int64_t n = 0;               // rows per request
  void* values = nullptr;           // values (write: read from) or out (gather: written)
  DType dtype = DType::f32;
  std::int64_t batch_stride = 0, row_stride = 0;  // elements; unit stride in dim
  int num_threads = 1;

  std::int64_t rows() const { return static_cast<std::int64_t>(slots.size()); }
  std::int64_t offset(std::int64_t row) const { return (row / n) * batch_stride + (row % n) * row_stride; }
};

namespace reference {
void cache_write(const CacheRowsProblem& problem);
void cache_gather(const CacheRowsProblem& problem);
}  // namespace reference
namespace cpu {
void cache_write(const CacheRowsProblem& problem);
void cache_gather(const CacheRowsProblem& problem);
}  // namespace cpu

}  // namespace dsa
