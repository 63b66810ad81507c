// Internal: the paged decode indexer's problem after validation, shared by its backends.
#pragma once

#include <cstdint>
#include <vector>

#include "core/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa {

struct IndexerDecodeProblem {
  DType dtype = DType::f32;  // of index_query
  std::int64_t batch = 0, next_n = 0, heads = 0, dim = 0;
  const void* query = nullptr;  // elements: b * q_batch_stride + j * q_row_stride + h * q_head_stride + d
  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  const void* weights = nullptr;  // elements: b * w_batch_stride + j * w_row_stride + h * w_head_stride
  DType weights_dtype = DType::f32;
  std::int64_t w_batch_stride = 0, w_row_stride = 0, w_head_stride = 0;
  core::PagedCache keys;
  core::BlockTable table;
  std::vector<std::int64_t> context_lens;  // [B]
  std::int64_t topk = 0, cmp_ratio = 1;
  float scale = 1.0f;
  int num_threads = 1;
  std::int32_t* indices = nullptr;  // [B, next_n, topk] contiguous

  std::int64_t rows() const { return batch * next_n; }
  std::int64_t position(std::int64_t b, std::int64_t j) const { return context_lens[b] - next_n + j; }
  // Keys row (b, j) sees: raw tokens 0..position, or the compressed entries before it.
  std::int64_t visible(std::int64_t b, std::int64_t j) const { return (position(b, j) + 1) / cmp_ratio; }
  float weight(std::int64_t b, std::int64_t j, std::int64_t h) const;
};

namespace reference {
void indexer_decode(const IndexerDecodeProblem& problem);
}
namespace cpu {
void indexer_decode(const IndexerDecodeProblem& problem);
}

}  // namespace dsa
