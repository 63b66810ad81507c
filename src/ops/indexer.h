// Internal: the indexer problem after validation, shared by its backends.
#pragma once

#include <cstdint>

#include "core/sequences.h"
#include "dsa/layout.h"
#include "dsa/tensor.h"

namespace dsa {

struct IndexerProblem {
  const void* query = nullptr;  // [rows, heads, dim], unit stride in dim
  DType dtype = DType::f32;     // of query and key
  std::int64_t query_row_stride = 0, query_head_stride = 0;
  std::int64_t heads = 0, dim = 0;
  const void* key = nullptr;  // [key rows, dim]
  std::int64_t key_row_stride = 0;
  const void* weights = nullptr;  // [rows, heads]
  DType weights_dtype = DType::f32;
  std::int64_t weights_row_stride = 0, weights_head_stride = 0;
  std::int32_t* indices = nullptr;  // [rows, topk], contiguous
  float* scores = nullptr;          // [rows, topk], contiguous, or null
  std::int64_t topk = 0;
  float scale = 1.0f;
  std::int64_t ratio = 1;
  int num_threads = 1;
  // Keys of sequence b are rows [c_begin, c_begin + c_len) of `key`; query i of
  // it sees the first visible_compressed(position(i), ratio) of them.
  core::SequencePlan plan;
};

// Validates the indexer inputs every indexer-scoring op takes (dsa_indexer, the
// KL losses, the dense LSE): ranks, dtypes, one shared key head, matching Hi/Di
// and leading dims. `lead` is 0 for TND, 1 for BSND.
void validate_indexer_inputs(const TensorView& index_query, const TensorView& index_key,
                             const TensorView& weights, const char* weights_name, int lead);

// The sequences of an indexer-scoring op's rows: index_query's rows against
// index_key's (compressed entries where ratio > 1), from the layout and cu_seqlens.
core::SequencePlan plan_indexer_sequences(const TensorView& index_query, const TensorView& index_key, Layout layout,
                                          std::int64_t ratio, const CuSeqlens& cu_q, const CuSeqlens& cu_k,
                                          int lead);

namespace reference {
void indexer_topk(const IndexerProblem& problem);
}
namespace cpu {
void indexer_topk(const IndexerProblem& problem);
}

}  // namespace dsa
