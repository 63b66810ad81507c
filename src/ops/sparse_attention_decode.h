// Internal: the sparse decode attention problem after validation, shared by
// its backends, and the one definition of a row's attended set.
#pragma once

#include <cstdint>
#include <vector>

#include "core/paged_cache.h"
#include "dsa/tensor.h"

namespace dsa {

struct SparseAttentionDecodeProblem {
  DType dtype = DType::f32;  // of query and out
  std::int64_t batch = 0, next_n = 0, heads = 0, dim = 0, d_v = 0;
  const void* query = nullptr;  // elements: b * q_batch_stride + j * q_row_stride + h * q_head_stride + d
  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;

  core::PagedCache kv;
  core::BlockTable kv_table;
  std::vector<std::int64_t> context_lens;  // [B]
  std::vector<std::int64_t> topk_lens;     // [B]: entries of `indices` used; topk without topk_lens

  const std::int32_t* indices = nullptr;  // null: the band
  std::int64_t idx_batch_stride = 0, idx_row_stride = 0, topk = 0;

  bool has_cmp = false;
  core::PagedCache cmp;
  core::BlockTable cmp_table;
  const std::int32_t* cmp_indices = nullptr;  // null with has_cmp: every visible entry
  std::int64_t cidx_batch_stride = 0, cidx_row_stride = 0, cmp_topk = 0;

  const float* sinks = nullptr;  // [heads] or null
  float scale = 1.0f;
  std::int64_t window = 0, cmp_ratio = 1;
  int num_threads = 1;

  void* out = nullptr;  // [B, next_n, heads, d_v] contiguous, dtype
  float* lse = nullptr;  // [B, next_n, heads] contiguous

  std::int64_t rows() const { return batch * next_n; }
  // Raw position of row j of request b.
  std::int64_t position(std::int64_t b, std::int64_t j) const { return context_lens[b] - next_n + j; }
  // Compressed entries a row sees.
  std::int64_t cmp_visible(std::int64_t b, std::int64_t j) const {
    return has_cmp ? (position(b, j) + 1) / cmp_ratio : 0;
  }
  // Upper bound on a row's attended keys (sizes per-thread lists).
  std::int64_t max_attended() const;

  // Calls f(compressed, position) for every key row (b, j) attends, in order:
  // the raw part, then the compressed part (docs/serving.md).
  template <class F>
  void for_each_attended(std::int64_t b, std::int64_t j, const F& f) const {
    const std::int64_t pos = position(b, j);
    if (indices) {
      const std::int32_t* idx = indices + b * idx_batch_stride + j * idx_row_stride;
      for (std::int64_t k = 0; k < topk_lens[b]; ++k)
        if (idx[k] >= 0 && idx[k] <= pos) f(false, static_cast<std::int64_t>(idx[k]));
    } else {
      const std::int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
      for (std::int64_t t = lo; t <= pos; ++t) f(false, t);
    }
    if (!has_cmp) return;
    const std::int64_t visible = cmp_visible(b, j);
    if (cmp_indices) {
      const std::int32_t* idx = cmp_indices + b * cidx_batch_stride + j * cidx_row_stride;
      for (std::int64_t k = 0; k < cmp_topk; ++k)
        if (idx[k] >= 0 && idx[k] < visible) f(true, static_cast<std::int64_t>(idx[k]));
    } else {
      for (std::int64_t w = 0; w < visible; ++w) f(true, w);
    }
  }
  // The cache record of an attended key.
  const std::uint8_t* record(std::int64_t b, bool compressed, std::int64_t pos) const {
    return compressed ? cmp.token(cmp_table.slot(b, pos)) : kv.token(kv_table.slot(b, pos));
  }
};

namespace reference {
void sparse_attention_decode(const SparseAttentionDecodeProblem& problem);
}
namespace cpu {
void sparse_attention_decode(const SparseAttentionDecodeProblem& problem);
}

}  // namespace dsa
