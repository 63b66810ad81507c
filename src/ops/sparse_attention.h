// Internal: the sparse attention problem after validation, shared by its backends.
//
// All query-side tensors are flattened to rows (T, or B * Sq for BSND); key
// tensors to rows of the packed raw / compressed key tensors. Strides are in
// elements; every last dim has unit stride.
#pragma once

#include <cstdint>

#include "core/sequences.h"
#include "dsa/tensor.h"

namespace dsa {

struct SparseAttentionProblem {
  DType dtype = DType::f32;  // of query, kv, cmp_kv, ropes, out, grad_out and the gradients
  std::int64_t heads = 0;
  std::int64_t dim = 0;       // D: key dims held by kv / cmp_kv
  std::int64_t rope_dim = 0;  // Dr: trailing key dims from query_rope / key_rope (0: none)
  std::int64_t d_v = 0;       // value dims: the first d_v of kv / cmp_kv
  std::int64_t qk_dim() const { return dim + rope_dim; }

  const void* query = nullptr;
  std::int64_t q_row_stride = 0, q_head_stride = 0;
  const void* query_rope = nullptr;
  std::int64_t qr_row_stride = 0, qr_head_stride = 0;
  const void* kv = nullptr;
  std::int64_t kv_row_stride = 0, kv_rows = 0;
  const void* key_rope = nullptr;
  std::int64_t kr_row_stride = 0;
  const void* cmp_kv = nullptr;  // null: no compressed part
  std::int64_t cmp_row_stride = 0, cmp_rows = 0;

  const std::int32_t* indices = nullptr;  // null: causal band (window)
  std::int64_t idx_row_stride = 0, topk = 0;
  const std::int32_t* cmp_indices = nullptr;  // null with cmp_kv: every visible entry
  std::int64_t cidx_row_stride = 0, cmp_topk = 0;
  const float* sinks = nullptr;  // [heads] or null

  float scale = 1.0f;
  std::int64_t window = 0;  // 0: unbounded
  std::int64_t ratio = 1;
  int num_threads = 1;
  core::SequencePlan plan;

  // Forward outputs, contiguous [rows, heads, d_v] and [rows, heads].
  void* out = nullptr;
  float* softmax_max = nullptr;
  float* softmax_sum = nullptr;

  // Backward inputs (grad_out / fwd_out strided like query; stats contiguous [rows, heads]).
  const void* grad_out = nullptr;
  std::int64_t go_row_stride = 0, go_head_stride = 0;
  const void* fwd_out = nullptr;
  std::int64_t o_row_stride = 0, o_head_stride = 0;
  const float* saved_max = nullptr;
  const float* saved_sum = nullptr;

  // Backward outputs, contiguous like their inputs: d_query [rows, heads, dim],
  // d_kv [kv_rows, dim], d_query_rope [rows, heads, rope_dim],
  // d_key_rope [kv_rows, rope_dim], d_cmp_kv [cmp_rows, dim], d_sinks [heads].
  void* d_query = nullptr;
  void* d_kv = nullptr;
  void* d_query_rope = nullptr;
  void* d_key_rope = nullptr;
  void* d_cmp_kv = nullptr;
  float* d_sinks = nullptr;

  // What query `row` (query i of sequence `seq`) attends, besides explicit lists.
  struct RowWindow {
    std::int64_t pos;         // raw key position of the query
    std::int64_t raw_lo;      // band start (inclusive) when there are no indices
    std::int64_t cmp_visible; // compressed entries visible: w < cmp_visible
  };
  RowWindow row_window(const core::SequenceSlice& seq, std::int64_t i) const {
    RowWindow w;
    w.pos = seq.position(i);
    w.raw_lo = window > 0 ? (w.pos - window + 1 > 0 ? w.pos - window + 1 : 0) : 0;
    w.cmp_visible = cmp_kv ? visible_compressed(w.pos, ratio) : 0;
    if (w.cmp_visible > seq.c_len) w.cmp_visible = seq.c_len;
    return w;
  }
};

namespace reference {
void sparse_attention_fwd(const SparseAttentionProblem& problem);
void sparse_attention_bwd(const SparseAttentionProblem& problem);
}  // namespace reference
namespace cpu {
void sparse_attention_fwd(const SparseAttentionProblem& problem);
void sparse_attention_bwd(const SparseAttentionProblem& problem);
}  // namespace cpu

}  // namespace dsa
